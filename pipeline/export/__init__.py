"""Hugging Face export of Prism checkpoints (hf.py) and the remote-code model it ships for the Prism arm
(configuration_prism.py, modeling_prism.py)."""

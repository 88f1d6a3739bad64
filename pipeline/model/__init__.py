"""The Prism GPT on megatron-core: per-layer head counts, per-d_h RoPE, SDPA core attention.

Contract (others code against it): build_model, lm_loss, logits, capture_attention. Parameter counts, FLOPs
per token and the padded vocabulary are pipeline.model_size's (torch-free). Importing this package imports
torch and megatron: the CLI imports it inside its verbs.
"""

from pipeline.model.capture import capture_attention
from pipeline.model.gpt import build_model, lm_loss, logits

__all__ = ["build_model", "capture_attention", "lm_loss", "logits"]

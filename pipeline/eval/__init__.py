"""Zero-shot evaluation of checkpoints through lm-evaluation-harness (`prism eval`)."""

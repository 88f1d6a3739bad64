"""The Prism GPT on megatron-core: per-layer head counts, per-d_h RoPE, SDPA core attention.

Contract (others code against it): build_model, lm_loss, logits, padded_vocab_size, flops_per_token,
capture_attention. Importing this package imports torch and megatron: the CLI imports it inside its verbs.
"""

from pipeline.model.capture import capture_attention
from pipeline.model.gpt import build_model, flops_per_token, lm_loss, logits, padded_vocab_size

__all__ = ["build_model", "capture_attention", "flops_per_token", "lm_loss", "logits", "padded_vocab_size"]

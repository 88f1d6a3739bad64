"""The Prism GPT on megatron-core: per-layer head counts, per-d_h RoPE, SDPA core attention.

Contract (others code against it): build_model, lm_loss, logits, padded_vocab_size, flops_per_token,
capture_attention. They load lazily, so importing `pipeline.model.cli` (for `prism --help`) stays free of
torch and megatron.
"""

import importlib

_EXPORTS = {
    "build_model": "pipeline.model.gpt",
    "lm_loss": "pipeline.model.gpt",
    "logits": "pipeline.model.gpt",
    "padded_vocab_size": "pipeline.model.gpt",
    "flops_per_token": "pipeline.model.gpt",
    "capture_attention": "pipeline.model.capture",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pipeline.model' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)

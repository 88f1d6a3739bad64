"""Fused elementwise work by config: `model.fusions` (megatron's fusion flags that run without TE) and
`train.compile` (torch.compile of the whole model).

model.fusions=megatron turns on the flags of megatron-core's TransformerConfig whose fused code path exists
in the local (non-TE) layer spec and runs on CPU as well as CUDA:
- bias_activation_fusion: SwiGLU (and GeLU with a bias) as one fused function with its own backward
  (megatron.core.fusions.fused_bias_swiglu / fused_bias_gelu, compiled by megatron's jit_fuser);
- bias_dropout_fusion: the residual bias-dropout-add as one fused function.
Left off, and why: apply_rope_fusion (our PrismSelfAttention applies RoPE per head dim itself, megatron's
rope is never called), persist_layer_norm (only TE's / apex's LayerNorm read it; the local spec's norm does
not), masked_softmax_fusion (only megatron's own core attention, CUDA kernels), gradient_accumulation_fusion
(needs TE's or apex's CUDA weight-gradient kernels). model.spec=transformer_engine fuses these inside TE.
"""

from __future__ import annotations

import logging
from typing import Any

from pipeline.config import Config

log = logging.getLogger(__name__)


def megatron_fusion_flags(cfg: Config) -> dict[str, bool]:
    """TransformerConfig kwargs for model.fusions (none: megatron's defaults, all off)."""
    m = cfg.model
    if m.fusions == "none":
        return {}
    # megatron refuses a fused GeLU without a bias (it fuses bias + GeLU); SwiGLU fuses with or without one
    activation = m.activation == "swiglu" or m.bias
    return {"bias_activation_fusion": activation, "bias_dropout_fusion": True}


def compile_model(cfg: Config, model: Any) -> Any:
    """train.compile: torch.compile the model in place (nn.Module.compile keeps parameter names, so
    checkpoints stay interchangeable with uncompiled runs). Compiles on the first forward."""
    if cfg.train.compile:
        model.compile()
        log.info("model: torch.compile on (compiles at the first step)")
    return model

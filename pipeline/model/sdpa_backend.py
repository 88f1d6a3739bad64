"""Which scaled_dot_product_attention kernel runs, per distinct head dim; `model.attention_backend` pins one.

`model.attention_backend`: sdpa (torch chooses), or one SDPA kernel pinned with torch.nn.attention.sdpa_kernel:
flash | cudnn | efficient | math. (`megatron` is megatron's own DotProductAttention, not SDPA.)
At build time every distinct head dim of the plan is probed once on the training device and dtype: the log
names the kernel each d_h gets, and a pinned kernel that cannot run there is refused with one line.
"""

from __future__ import annotations

import logging

import torch

from pipeline.config import Config, ConfigError

log = logging.getLogger(__name__)

PINNED = ("flash", "cudnn", "efficient", "math")


def _backend(name: str):
    from torch.nn.attention import SDPBackend

    return {
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }[name]


def pinned_backend(cfg: Config):
    """The SDPBackend to pin, or None when torch chooses (sdpa) or SDPA is not used (megatron)."""
    name = cfg.model.attention_backend
    return _backend(name) if name in PINNED else None


def _probe(head_dim: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    return torch.zeros(1, 1, 16, head_dim, dtype=dtype, device=device)


def chosen_kernel(head_dim: int, dtype: torch.dtype, device: str) -> str:
    """The kernel torch's dispatcher picks for causal attention at this head dim (torch._fused_sdp_choice)."""
    from torch.nn.attention import SDPBackend

    q = _probe(head_dim, dtype, device)
    return SDPBackend(torch._fused_sdp_choice(q, q, q, is_causal=True)).name


def runs(backend, head_dim: int, dtype: torch.dtype, device: str) -> bool:
    from torch.nn.attention import sdpa_kernel

    q = _probe(head_dim, dtype, device)
    try:
        with sdpa_kernel(backend):
            torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    except RuntimeError:
        return False
    return True


def check_and_log(cfg: Config, device: str) -> dict[int, str]:
    """{head_dim: kernel} for the plan's distinct head dims; one ConfigError line if a pinned kernel cannot run."""
    name = cfg.model.attention_backend
    if name == "megatron":
        return {}
    dtype = torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32
    dims = sorted({layer.head_dim for layer in cfg.layer_plan})
    pinned = pinned_backend(cfg)
    kernels = {}
    for d in dims:
        if pinned is not None and not runs(pinned, d, dtype, device):
            raise ConfigError(
                f"{cfg.source}: model.attention_backend: {name} attention cannot run on {device} "
                f"({cfg.train.precision}, head dim {d}); use sdpa (torch chooses) or math"
            )
        kernels[d] = pinned.name if pinned is not None else chosen_kernel(d, dtype, device)
    where = f"{device}" + (" (CPU: torch's CPU kernels, no GPU attention)" if device == "cpu" else "")
    log.info(
        "attention: SDPA kernel per head dim on %s, %s: %s",
        where,
        "pinned" if pinned is not None else "torch's choice",
        ", ".join(f"d_h {d} -> {k}" for d, k in kernels.items()),
    )
    return kernels

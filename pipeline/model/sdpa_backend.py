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


def kernels_by_head_dim(cfg: Config, device: str) -> dict[int, str]:
    """{head_dim: kernel} for the plan's distinct head dims, asked of torch on ``device`` at the training dtype;
    one ConfigError line if a pinned kernel cannot run one of them. {} for megatron's own attention."""
    name = cfg.model.attention_backend
    if name == "megatron":
        return {}
    dtype = torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32
    pinned = pinned_backend(cfg)
    kernels = {}
    for d in sorted({layer.head_dim for layer in cfg.layer_plan}):
        if pinned is not None and not runs(pinned, d, dtype, device):
            raise ConfigError(
                f"{cfg.source}: model.attention_backend: {name} attention cannot run on {device} "
                f"({cfg.train.precision}, head dim {d}); use sdpa (torch chooses) or math"
            )
        kernels[d] = pinned.name if pinned is not None else chosen_kernel(d, dtype, device)
    return kernels


def layer_kernels(cfg: Config, device: str) -> list[str]:
    """The kernel each layer's attention gets, in layer order (kernels_by_head_dim's answer per layer)."""
    by_dim = kernels_by_head_dim(cfg, device)
    return [by_dim[layer.head_dim] for layer in cfg.layer_plan] if by_dim else []


def check_and_log(cfg: Config, device: str) -> dict[int, str]:
    """kernels_by_head_dim, logged: what build_model calls, so a pinned kernel that cannot run stops the build."""
    kernels = kernels_by_head_dim(cfg, device)
    if not kernels:
        return {}
    where = f"{device}" + (" (CPU: torch's CPU kernels, no GPU attention)" if device == "cpu" else "")
    log.info(
        "attention: SDPA kernel per head dim on %s, %s: %s",
        where,
        "pinned" if pinned_backend(cfg) is not None else "torch's choice",
        ", ".join(f"d_h {d} -> {k}" for d, k in kernels.items()),
    )
    return kernels


# Kernels that are the fast path on a GPU; anything else there is a fallback worth a warning.
FAST_ON_GPU = ("FLASH_ATTENTION", "CUDNN_ATTENTION")


def _layer_spans(cfg: Config, kernels: list[str]) -> list[tuple[int, int, int, str]]:
    """Runs of consecutive layers with the same head dim and kernel: (first, last, head_dim, kernel), 1-based."""
    spans: list[tuple[int, int, int, str]] = []
    for i, (layer, k) in enumerate(zip(cfg.layer_plan, kernels), start=1):
        if spans and spans[-1][2:] == (layer.head_dim, k) and spans[-1][1] == i - 1:
            spans[-1] = (spans[-1][0], i, layer.head_dim, k)
        else:
            spans.append((i, i, layer.head_dim, k))
    return spans


def _layers(first: int, last: int) -> str:
    return f"layer {first}" if first == last else f"layers {first}-{last}"


def kernel_line(cfg: Config, kernels: list[str], device: str) -> str:
    """One line: which kernel each layer gets, e.g. "attention on cuda bf16 (torch's choice): layers 1-2 d_h 256
    FLASH_ATTENTION, ...". On CPU torch's FLASH_ATTENTION is its CPU kernel, not FlashAttention-2."""
    how = "pinned" if pinned_backend(cfg) is not None else "torch's choice"
    spans = ", ".join(f"{_layers(a, b)} d_h {d} {k}" for a, b, d, k in _layer_spans(cfg, kernels))
    return f"attention on {device} {cfg.train.precision} ({how}): {spans}"


def fallback_warning(cfg: Config, kernels: list[str], device: str) -> str | None:
    """On a GPU, the layers whose attention is neither flash nor cuDNN, in one line; None when there are none."""
    if device != "cuda":
        return None
    slow = [(a, b, d, k) for a, b, d, k in _layer_spans(cfg, kernels) if k not in FAST_ON_GPU]
    if not slow:
        return None
    spans = ", ".join(f"{_layers(a, b)} (d_h {d}) {k}" for a, b, d, k in slow)
    return (
        f"attention falls back from flash/cuDNN in {spans}: expect these layers to be slower "
        "(FlashAttention-2 takes head dims up to 256, multiples of 8; see docs/performance.md)"
    )


def kernel_params(cfg: Config, kernels: list[str]) -> dict[str, str]:
    """MLflow params: the kernel per distinct head dim and the layers that fall back on a GPU."""
    by_dim = {layer.head_dim: k for layer, k in zip(cfg.layer_plan, kernels)}
    params = {f"attention/kernel_dh{d}": k for d, k in sorted(by_dim.items())}
    params["attention/kernel_layers"] = ",".join(kernels)
    return params


def plan_note(cfg: Config, gpu: str) -> list[str]:
    """What `prism plan --gpu GPU` says about attention kernels: torch's answer per layer when this machine has
    that GPU, else where to get it (torch answers for the device it runs on, never for a named one)."""
    from pipeline.hardware import find_gpu

    here = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    try:
        same = here is not None and find_gpu(here) == find_gpu(gpu)
    except ValueError:
        same = False
    if not same:
        return [
            f"  attention    the SDPA kernel per layer is torch's answer on the GPU itself: run `prism model report "
            f"{cfg.source} train.precision={cfg.train.precision}` on a node with that GPU ({gpu})"
        ]
    kernels = layer_kernels(cfg, "cuda")
    warning = fallback_warning(cfg, kernels, "cuda")
    return [f"  attention    {kernel_line(cfg, kernels, 'cuda')}"] + ([f"  warning      {warning}"] if warning else [])

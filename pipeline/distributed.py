"""Process plumbing the trainer, the model and the readers share: the device, and the collectives.

Library quirks (megatron-core or DeepSpeed assuming CUDA, version differences) are not here but in
pipeline.compat; this module only says which device a process uses and how ranks exchange tensors.
"""

from __future__ import annotations

from typing import Any

from pipeline.config import ConfigError


class DeviceError(ConfigError):
    """The requested device is not there (one line: what was asked and what to use instead)."""


def resolve_device(requested: str = "auto") -> str:
    """'cuda' or 'cpu' for a requested 'auto' | 'cpu' | 'cuda' (auto: CUDA when a GPU is visible)."""
    import torch

    if requested not in ("auto", "cpu", "cuda"):
        raise DeviceError(f"device {requested!r} is not one of auto, cpu, cuda")
    if requested == "cuda" and not torch.cuda.is_available():
        raise DeviceError("device cuda was asked for but no CUDA device is visible; use cpu or auto")
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested


def tp_all_gather(tensor: Any, dim: int) -> Any:
    """Concatenate every tensor-parallel rank's ``tensor`` along ``dim`` (rank order); no gradient.

    megatron's gather helper allocates its output on the CUDA device; a plain all_gather works on both."""
    import torch
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1:
        return tensor
    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(tp)]
    torch.distributed.all_gather(parts, tensor, group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=dim)


def dp_mean(value: Any, device: str) -> float:
    """Mean of a scalar over the data-parallel group (TP peers already agree)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    t = torch.as_tensor(value, dtype=torch.float32, device=device).clone()
    dist.all_reduce(t, group=parallel_state.get_data_parallel_group())
    return float(t) / parallel_state.get_data_parallel_world_size()

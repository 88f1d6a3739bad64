"""Peak FLOP/s per GPU model and the two FLOP conventions MFU is reported in.

MFU = achieved training FLOP/s / (peak FLOP/s x GPUs). The peak is the dense (no 2:4 sparsity) bf16
tensor-core figure of the vendor's datasheet, looked up by the EXACT name torch.cuda.get_device_name()
prints: "NVIDIA H100 80GB HBM3" (SXM) and "NVIDIA H100 PCIe" differ by 30 %, so a substring match ("H100")
would silently pick the wrong one. A device not in the table gets no MFU (one log line says so);
`train.peak_flops` overrides the table.

FLOP conventions (both logged): `mfu` counts attention's score and weighted-sum matmuls in full
(PaLM's convention, pipeline.model.flops_per_token); `mfu_causal` halves them, since a causal mask needs
only the lower triangle (Megatron's and llm.c's counting).
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

# Dense bf16 tensor-core peak (FLOP/s) by torch.cuda.get_device_name(), from NVIDIA's datasheets.
# Cards without bf16 tensor cores (V100, T4) are left out on purpose: no honest bf16 peak exists.
PEAK_BF16_FLOPS = {
    # Hopper
    "NVIDIA H100 80GB HBM3": 989.5e12,  # H100 SXM5
    "NVIDIA H100 PCIe": 756.5e12,
    "NVIDIA H100 NVL": 835.5e12,
    "NVIDIA H200": 989.5e12,  # H200 SXM
    "NVIDIA H200 NVL": 835.5e12,
    "NVIDIA GH200 480GB": 989.5e12,
    "NVIDIA GH200 144G HBM3e": 989.5e12,
    # Ampere
    "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-PCIE-40GB": 312e12,
    "NVIDIA A100 80GB PCIe": 312e12,
    "NVIDIA A40": 149.7e12,
    "NVIDIA A30": 165e12,
    "NVIDIA A10": 125e12,
    # Ada
    "NVIDIA L40S": 362.05e12,
    "NVIDIA L40": 181.05e12,
    "NVIDIA L4": 121e12,
    # Blackwell
    "NVIDIA B200": 2250e12,
}

_UNKNOWN_LOGGED: set[str] = set()


def peak_bf16_flops(device_name: str) -> float | None:
    """The table's peak for exactly this device name (surrounding spaces ignored), None if unknown."""
    return PEAK_BF16_FLOPS.get(device_name.strip())


def device_peak_flops(override: float | None, device: str) -> float | None:
    """Peak FLOP/s per device for MFU: the override when set, else the table entry of this CUDA device;
    None on CPU or on an unknown GPU (logged once per name, naming the override key)."""
    if override:
        return override
    if device != "cuda":
        return None
    import torch

    name = torch.cuda.get_device_name()
    peak = peak_bf16_flops(name)
    if peak is None and name not in _UNKNOWN_LOGGED:
        _UNKNOWN_LOGGED.add(name)
        log.warning("mfu: no bf16 peak known for GPU %r, MFU is not logged; set train.peak_flops to log it", name)
    return peak


def causal_attention_discount(flops_per_token_full: int, heads: tuple[int, ...], d_model: int, seq_len: int) -> int:
    """Training FLOPs per token with attention's two matmuls halved (causal convention), from the full count.

    Per layer the full count has 2 * 2 * h_l * d_h * seq_len forward attention FLOPs (h_l * d_h = d_model);
    forward + backward is 3x that; the causal count keeps half of it."""
    attention_full = 3 * sum(2 * 2 * h * (d_model // h) * seq_len for h in heads)
    return flops_per_token_full - attention_full // 2

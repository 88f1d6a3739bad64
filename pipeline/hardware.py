"""Peak FLOP/s per GPU model and the two FLOP conventions MFU is reported in.

MFU = achieved training FLOP/s / (peak FLOP/s x GPUs). The peak is the dense (no 2:4 sparsity) bf16
tensor-core figure of the vendor's datasheet, looked up by the EXACT name torch.cuda.get_device_name()
prints: "NVIDIA H100 80GB HBM3" (SXM) and "NVIDIA H100 PCIe" differ by 30 %, so a substring match ("H100")
would silently pick the wrong one. A device not in the table gets no MFU (one log line says so);
`train.peak_flops` overrides the table.

People type shorter names (`prism plan --gpu H200`): `find_gpu` matches them by words, and refuses a name
that could mean two different peaks.

FLOP conventions (both logged): `mfu` counts attention's score and weighted-sum matmuls in full
(PaLM's convention); `mfu_causal` halves them (pipeline.model_size.flops_per_token(causal=True)): a causal mask needs
only the lower triangle (Megatron's and llm.c's counting).
"""

from __future__ import annotations

import logging
import re

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

# Names people use that torch's device name does not contain (the form factor): matched like table names.
GPU_ALIASES = {
    "NVIDIA H100 80GB HBM3": "H100 SXM5",
    "NVIDIA H200": "H200 SXM",
}

_UNKNOWN_LOGGED: set[str] = set()


def peak_bf16_flops(device_name: str) -> float | None:
    """The table's peak for exactly this device name (surrounding spaces ignored), None if unknown."""
    return PEAK_BF16_FLOPS.get(device_name.strip())


def _words(name: str) -> list[str]:
    return re.split(r"[\s\-_]+", name.strip().lower())


def find_gpu(query: str) -> str:
    """The table name a person means by `query` (`H200`, `h100 sxm`, `A100-80GB`): every word of it
    starts a word of the name or its alias (case, spaces, '-' and '_' ignored), so `H200` is not `GH200`.
    Of several matches, one whose words (less `NVIDIA`) are exactly the query's wins (`H200` is not
    `H200 NVL`); matches that all share one peak are equal for MFU. Otherwise ValueError listing them."""
    want = [w for w in _words(query) if w]
    if not want:
        raise ValueError("--gpu is empty; pass a GPU name such as H100 or 'NVIDIA H100 80GB HBM3'")

    def spellings(name: str) -> list[list[str]]:
        return [_words(n) for n in (name, GPU_ALIASES.get(name)) if n]

    def matches(words: list[str]) -> bool:
        return all(any(w.startswith(q) for w in words) for q in want)

    found = [name for name in PEAK_BF16_FLOPS if any(matches(words) for words in spellings(name))]
    exact = [name for name in found if any([w for w in s if w != "nvidia"] == want for s in spellings(name))]
    if len(exact) == 1:
        return exact[0]
    if found and len({PEAK_BF16_FLOPS[name] for name in found}) == 1:
        return found[0]
    if not found:
        raise ValueError(
            f"--gpu {query!r} matches no GPU in the peak-FLOPs table ({', '.join(PEAK_BF16_FLOPS)}); "
            "pass --peak-tflops instead"
        )
    listed = ", ".join(f"{name} ({PEAK_BF16_FLOPS[name] / 1e12:g} TFLOP/s)" for name in found)
    raise ValueError(f"--gpu {query!r} is ambiguous, it matches {listed}; pass more of the name")


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

"""Peak FLOPs by exact device name and the two MFU conventions (issue 12 item 9).

Names are what torch.cuda.get_device_name() prints on those machines."""

from __future__ import annotations

import pytest

from pipeline import config
from pipeline.hardware import PEAK_BF16_FLOPS, peak_bf16_flops


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989.5e12),  # SXM
        ("NVIDIA H100 PCIe", 756.5e12),
        ("NVIDIA H100 NVL", 835.5e12),
        ("NVIDIA H200", 989.5e12),
        ("NVIDIA H200 NVL", 835.5e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100-SXM4-40GB", 312e12),
        ("NVIDIA A100-PCIE-40GB", 312e12),
        ("NVIDIA A100 80GB PCIe", 312e12),
        ("NVIDIA L40S", 362.05e12),
        ("NVIDIA L40", 181.05e12),
        ("NVIDIA L4", 121e12),
        ("NVIDIA A10", 125e12),
        # no bf16 tensor cores, or not in the table: no MFU rather than a wrong one
        ("Tesla V100-SXM2-32GB", None),
        ("Tesla T4", None),
        ("NVIDIA A10G", None),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_real_device_names(name, peak):
    assert peak_bf16_flops(name) == peak


def test_no_entry_is_found_by_a_substring_of_another_device():
    # the old table matched "L4" inside "NVIDIA L40S" and "H100" inside every H100 variant
    for name, peak in PEAK_BF16_FLOPS.items():
        assert peak_bf16_flops(f"  {name}\n") == peak
        assert peak_bf16_flops(name + " X") is None and peak_bf16_flops("X " + name) is None
    assert len({peak_bf16_flops(n) for n in ("NVIDIA L4", "NVIDIA L40", "NVIDIA L40S")}) == 3


def test_peak_flops_override_cpu_and_unknown_gpu(monkeypatch, caplog):
    import torch

    from pipeline.hardware import device_peak_flops

    def peak_flops(cfg, device):  # what the trainer's MFU asks for
        return device_peak_flops(cfg.train.peak_flops, device)

    cfg = config.load("configs/tiny_prism.yaml")
    assert peak_flops(cfg, "cpu") is None
    assert peak_flops(config.load("configs/tiny_prism.yaml", ["train.peak_flops=1e15"]), "cpu") == 1e15
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA L40S")
    assert peak_flops(cfg, "cuda") == 362.05e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA Unknown 9000")
    with caplog.at_level("WARNING"):
        assert peak_flops(cfg, "cuda") is None
        assert peak_flops(cfg, "cuda") is None
    assert [r.getMessage() for r in caplog.records].count(
        "mfu: no bf16 peak known for GPU 'NVIDIA Unknown 9000', MFU is not logged; set train.peak_flops to log it"
    ) == 1


def test_causal_convention_halves_attention_only():
    from pipeline import model_size

    # hand count, one layer, d=256, 4 heads, seq 128, ffn 688 (SwiGLU), vocab 1024, forward x3 for training
    d, ffn, seq, vocab = 256, 688, 128, 1024
    proj, attn, mlp, logits = 8 * d * d, 4 * d * seq, 6 * d * ffn, 2 * d * vocab
    full = model_size.training_flops_per_token([4], d, ffn, seq, vocab)
    assert full == 3 * (proj + attn + mlp + logits)
    causal = model_size.training_flops_per_token([4], d, ffn, seq, vocab, causal=True)
    assert causal == 3 * (proj + attn // 2 + mlp + logits)

"""The chunked cross-entropy (pipeline.model.loss) against megatron's fp32 vocab-parallel cross-entropy."""

from __future__ import annotations

import pytest
import torch

from pipeline import config, distributed
from pipeline.model import loss as loss_mod


def megatron_ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    from megatron.core import tensor_parallel

    return tensor_parallel.vocab_parallel_cross_entropy(logits.float(), targets).mean()


@pytest.fixture(autouse=True)
def tp1():
    distributed.init_model_parallel(1, 1234)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_loss_and_grads_equal_megatron(monkeypatch, dtype):
    monkeypatch.setattr(loss_mod, "CHUNK_ELEMENTS", 7 * 300)  # 7 tokens per chunk: many chunks, a ragged last
    gen = torch.Generator().manual_seed(0)
    logits = (4 * torch.randn(3, 20, 300, generator=gen)).to(dtype)
    targets = torch.randint(0, 300, (3, 20), generator=gen)
    ours_in = logits.clone().requires_grad_()
    ref_in = logits.clone().requires_grad_()
    ours = loss_mod.chunked_cross_entropy(ours_in, targets)
    ref = megatron_ce(ref_in, targets)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=0)
    (2.5 * ours).backward()
    (2.5 * ref).backward()
    assert ours_in.grad.dtype == dtype  # the gradient stays in the logits' dtype
    torch.testing.assert_close(ours_in.grad.float(), ref_in.grad.float(), rtol=1e-5, atol=1e-7)


def test_lm_loss_of_the_model_equals_megatron_loss(monkeypatch):
    from pipeline.model import build_model, lm_loss
    from pipeline.model.gpt import _forward_local_logits

    monkeypatch.setattr(loss_mod, "CHUNK_ELEMENTS", 8192 * 16)
    cfg = config.load("configs/tiny_prism.yaml", ["model.seq_len=32"])
    model = build_model(cfg)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1))
    ours = lm_loss(model, tokens)
    ours.backward()
    ours_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    ref = megatron_ce(_forward_local_logits(model, tokens[:, :-1]), tokens[:, 1:])
    ref.backward()
    assert abs(ours.item() - ref.item()) <= 1e-5 * ref.item()
    for name, p in model.named_parameters():
        torch.testing.assert_close(ours_grads[name], p.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_no_fp32_copy_of_bf16_logits_is_kept_for_backward():
    """What autograd keeps between forward and backward: the bf16 logits and [N] vectors, no fp32 [N, V]."""
    logits = torch.randn(64, 1000).bfloat16().requires_grad_()
    targets = torch.randint(0, 1000, (64,))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss_mod.chunked_cross_entropy(logits, targets)
    big = [t for t in saved if t.numel() >= logits.numel()]
    assert big and all(t.dtype == torch.bfloat16 for t in big)
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        megatron_ce(logits, targets)
    assert any(t.dtype == torch.float32 and t.numel() >= logits.numel() for t in saved)  # the old path did

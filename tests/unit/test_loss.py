"""The chunked output projection + cross-entropy (pipeline.model.loss) against megatron's fp32 vocab-parallel
cross-entropy of the whole logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipeline import config, distributed
from pipeline.model import loss as loss_mod


def megatron_ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    from megatron.core import tensor_parallel

    return tensor_parallel.vocab_parallel_cross_entropy(logits.float(), targets).mean()


@pytest.fixture(autouse=True)
def tp1():
    distributed.init_model_parallel(1, 1234)


# grads of bf16 tensors: each side rounds its matmul outputs to bf16 (2^-8 relative) in another place
GRAD_TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-7), torch.bfloat16: dict(rtol=2e-2, atol=2e-4)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_loss_and_grads_equal_megatron(monkeypatch, dtype):
    monkeypatch.setitem(loss_mod.CHUNK_ELEMENTS, "cpu", 7 * 300)  # 7 tokens per chunk: many, a ragged last
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 20, 32, generator=gen).to(dtype)
    weight = (0.5 * torch.randn(300, 32, generator=gen)).to(dtype)
    targets = torch.randint(0, 300, (3, 20), generator=gen)
    ours_h, ours_w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref_h, ref_w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ours = loss_mod.linear_cross_entropy(ours_h, ours_w, targets)
    ref = megatron_ce(F.linear(ref_h, ref_w), targets)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=0)
    (2.5 * ours).backward()  # a scale on the loss, like DeepSpeed's 1 / grad_accum, reaches both gradients
    (2.5 * ref).backward()
    for mine, theirs in [(ours_h, ref_h), (ours_w, ref_w)]:
        assert mine.grad.dtype == dtype  # gradients stay in the parameters' dtype
        torch.testing.assert_close(mine.grad.float(), theirs.grad.float(), **GRAD_TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_z_loss_equals_plain_pytorch_palm_definition(monkeypatch, dtype):
    """train.z_loss = c: cross-entropy + c * mean over tokens of log-sum-exp(logits)^2 (PaLM), in the chunked
    loss, value and both gradients against plain PyTorch on the whole logits."""
    monkeypatch.setitem(loss_mod.CHUNK_ELEMENTS, "cpu", 7 * 300)  # several chunks, a ragged last one
    c = 1e-2  # large enough that the z term moves the loss and gradients far beyond the tolerance
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(3, 20, 32, generator=gen).to(dtype)  # lse ~ log(300): the z term is not small
    weight = (0.5 * torch.randn(300, 32, generator=gen)).to(dtype)
    targets = torch.randint(0, 300, (3, 20), generator=gen)
    ours_h, ours_w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref_h, ref_w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ours = loss_mod.linear_cross_entropy(ours_h, ours_w, targets, z_loss=c)
    logits = F.linear(ref_h, ref_w).float().reshape(-1, 300)
    ref = F.cross_entropy(logits, targets.reshape(-1)) + c * torch.logsumexp(logits, dim=-1).square().mean()
    plain_ce = loss_mod.linear_cross_entropy(hidden, weight, targets)
    assert abs(float(ours - plain_ce)) > 1e-2  # the term is really there
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=0)
    (2.5 * ours).backward()
    (2.5 * ref).backward()
    for mine, theirs in [(ours_h, ref_h), (ours_w, ref_w)]:
        assert mine.grad.dtype == dtype
        # bf16: the (1 + 2 c lse) factor moves a few values across a rounding boundary; one bf16 step (2^-8) of
        # the largest gradient still tells a missing or doubled z term (~10 % of every gradient) apart
        ulp = 2**-8 * float(theirs.grad.abs().max()) if dtype == torch.bfloat16 else 0.0
        tolerance = GRAD_TOLERANCE[dtype] | ({"atol": ulp} if ulp else {})
        torch.testing.assert_close(mine.grad.float(), theirs.grad.float(), **tolerance)


def test_lm_loss_of_the_model_equals_megatron_loss(monkeypatch):
    from pipeline.model import build_model, lm_loss
    from pipeline.model.gpt import _forward_local_logits

    monkeypatch.setitem(loss_mod.CHUNK_ELEMENTS, "cpu", 8192 * 16)
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
    with torch.no_grad():  # evaluation: the same loss, no gradient work
        assert abs(lm_loss(model, tokens).item() - ref.item()) <= 1e-5 * ref.item()


def saved_for_backward(fn) -> list[torch.Tensor]:
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fn()
    return saved


def test_no_logits_sized_tensor_is_kept_for_backward():
    """What autograd keeps between forward and backward: [tokens, d] and [V, d] tensors, nothing of the
    logits' [tokens, V] size in any dtype; megatron's path keeps the fp32 softmax."""
    tokens, vocab, d = 256, 1000, 16
    hidden = torch.randn(tokens, d).bfloat16().requires_grad_()
    weight = torch.randn(vocab, d).bfloat16().requires_grad_()
    targets = torch.randint(0, vocab, (tokens,))
    ours = saved_for_backward(lambda: loss_mod.linear_cross_entropy(hidden, weight, targets))
    assert ours and max(t.numel() for t in ours) < tokens * vocab
    theirs = saved_for_backward(lambda: megatron_ce(F.linear(hidden, weight), targets))
    assert any(t.dtype == torch.float32 and t.numel() >= tokens * vocab for t in theirs)

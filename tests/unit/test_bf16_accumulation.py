"""bf16 under DeepSpeed sums micro-batch gradients in fp32 (issue 12 item 4), checked on the CPU engine.

The reference is the same bf16 model outside DeepSpeed: each micro-batch's bf16 gradient of loss / grad_accum
(what the engine's backward computes), cast to fp32 and summed in fp32. The engine's accumulated gradient,
read through DeepSpeed's own `safe_get_full_grad` after the last backward and before the update, must match it
to 1e-5 relative (float32 summation order only); bf16 summation is off by ~1e-3 relative.
"""

from __future__ import annotations

import pytest

from pipeline import config

GRAD_ACCUM = 4
MICRO = 2
TINY = [
    "model.num_layers=2",
    "model.h_base=4",
    "schedule.heads=4x2",
    "model.seq_len=32",
    "model.vocab_size=512",
    "train.precision=bf16",
    f"train.micro_batch_size={MICRO}",
    f"train.batch_tokens={32 * MICRO * GRAD_ACCUM}",
]


@pytest.mark.parametrize("zero_stage", [1, 2])
def test_bf16_gradient_accumulation_matches_the_fp32_summed_reference(zero_stage):
    import torch
    from deepspeed.utils import safe_get_full_grad

    from pipeline import distributed
    from pipeline.model import build_model, lm_loss
    from pipeline.train.engine import build_engine

    cfg = config.load("configs/tiny_uniform.yaml", [*TINY, f"parallel.zero_stage={zero_stage}", "train.device=cpu"])
    distributed.init_model_parallel(1, cfg.run.seed)
    model = build_model(cfg)
    assert next(model.parameters()).dtype == torch.bfloat16
    reference_model = build_model(cfg)
    reference_model.load_state_dict(model.state_dict())
    engine, _ = build_engine(cfg, model, GRAD_ACCUM, dp_size=1)

    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, cfg.model.vocab_size, (MICRO, cfg.model.seq_len + 1), generator=gen) for _ in range(4)]
    names = [n for n, _ in reference_model.named_parameters()]
    reference = {n: torch.zeros(p.shape, dtype=torch.float32) for n, p in reference_model.named_parameters()}
    for tokens in batches:
        grads = torch.autograd.grad(lm_loss(reference_model, tokens) / GRAD_ACCUM, list(reference_model.parameters()))
        for n, g in zip(names, grads):
            assert g.dtype == torch.bfloat16
            reference[n] += g.float()

    for tokens in batches:  # no engine.step(): the accumulated gradient is read before the update
        engine.backward(lm_loss(engine, tokens))
    worst = 0.0
    for n, p in engine.module.named_parameters():
        got = safe_get_full_grad(p)
        assert got is not None, n
        want = reference[n]
        worst = max(worst, float((got.float() - want).norm() / want.norm()))
    assert worst < 1e-5, f"accumulated gradient is {worst:.2e} off the fp32-summed reference (bf16 summation?)"

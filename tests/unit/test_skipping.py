"""Skipped steps (pipeline.skipping, pipeline.compat.SkipStepAdamW): the fused AdamW's skip is an exact no-op,
the spike rule equals a plain reference over the same window, and the window survives a checkpoint."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pipeline.compat import SkipStepAdamW
from pipeline.skipping import StepSkipper


def adamw(flags: list[float] | None = None, dtype=torch.float32):
    """A SkipStepAdamW over two tensors (as DeepSpeed's two flat groups); ``flags`` are popped, one per step."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(1000, generator=gen).to(dtype)) for _ in range(2)]
    groups = [{"params": params[:1], "weight_decay": 0.1}, {"params": params[1:], "weight_decay": 0.0}]
    flag = None if flags is None else (lambda: torch.tensor(flags.pop(0)))
    return SkipStepAdamW(groups, skip_flag=flag, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, fused=True), params


def state_of(opt, params) -> list[torch.Tensor]:
    return [p.detach().clone() for p in params] + [
        v.clone() for p in params for v in opt.state[p].values() if torch.is_tensor(v)
    ]


def step_with(opt, params, grads):
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    opt.step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_skipped_step_changes_nothing_and_the_next_step_is_as_if_it_never_came(dtype):
    gen = torch.Generator().manual_seed(1)
    grads = [[torch.randn(1000, generator=gen).to(dtype) for _ in range(2)] for _ in range(3)]
    nan = [torch.full((1000,), math.nan, dtype=dtype), torch.full((1000,), math.inf, dtype=dtype)]
    skipping, params = adamw([0.0, 1.0, 1.0, 0.0, 0.0], dtype)
    plain, plain_params = adamw(None, dtype)
    step_with(skipping, params, grads[0])
    step_with(plain, plain_params, grads[0])
    before = state_of(skipping, params)
    step_with(skipping, params, nan)  # NaN/inf gradients: poison, unless skipped
    step_with(skipping, params, grads[1])  # finite, but the guard says skip (a spike)
    after = state_of(skipping, params)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))  # weights, moments, step counts
    for g in grads[1:]:
        step_with(skipping, params, g)
        step_with(plain, plain_params, g)
    got, want = state_of(skipping, params), state_of(plain, plain_params)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_skip_step_adamw_needs_the_fused_kernel():
    with pytest.raises(ValueError, match="fused=True"):
        SkipStepAdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)


def reference_decisions(losses, norms, window, sigma):
    """The rule in plain Python: skip a non-finite step, or (once half the window is there) one above
    mean + sigma * std (unbiased) of the last ``window`` finite steps, skipped or not."""
    seen_l, seen_n, out = [], [], []
    for loss, norm in zip(losses, norms, strict=True):
        finite = math.isfinite(loss) and math.isfinite(norm)
        skip = not finite
        if finite and len(seen_l) >= max(2, window // 2):
            wl, wn = np.array(seen_l[-window:]), np.array(seen_n[-window:])
            skip = loss > wl.mean() + sigma * wl.std(ddof=1) or norm > wn.mean() + sigma * wn.std(ddof=1)
        if finite:
            seen_l.append(loss)
            seen_n.append(norm)
        out.append(bool(skip))
    return out


def run_skipper(skipper, losses, norms):
    flags = []
    for loss, norm in zip(losses, norms, strict=True):
        skipper.arm(torch.tensor(loss))
        assert torch.equal(skipper.decide(torch.tensor(norm)), skipper.decide(torch.tensor(123.0)))  # once a step
        flags.append(bool(skipper.finish(torch.tensor(norm))))
    return flags


def noisy_run(steps=70, seed=0):
    rng = np.random.default_rng(seed)
    losses = list(5.0 - np.linspace(0, 1, steps) + rng.normal(0, 0.02, steps))
    norms = list(np.abs(rng.normal(1.0, 0.1, steps)))
    losses[20], norms[31], losses[32] = math.nan, 50.0, 9.0  # non-finite, a grad-norm spike, a loss spike
    losses[50:] = [x + 2.5 for x in losses[50:]]  # a lasting jump: the window widens within a few steps
    norms[45] = math.inf
    return losses, norms


def test_spike_rule_equals_the_plain_reference_and_counts():
    losses, norms = noisy_run()
    want = reference_decisions(losses, norms, window=16, sigma=3.0)
    skipper = StepSkipper(16, 3.0, "cpu")
    got = run_skipper(skipper, losses, norms)
    assert got == want
    assert [i for i, skip in enumerate(got) if skip] == [20, 31, 32, 45, 50, 51]  # the jump costs 2 steps
    assert not any(got[:8])  # the spike test waits for half a window
    assert int(skipper.total) == sum(want)
    in_a_row = 0
    for flag in want:
        in_a_row = in_a_row + 1 if flag else 0
    assert int(skipper.in_a_row) == in_a_row


def test_without_sigma_only_non_finite_steps_are_skipped():
    losses, norms = noisy_run()
    got = run_skipper(StepSkipper(16, None, "cpu"), losses, norms)
    assert [i for i, f in enumerate(got) if f] == [20, 45]


@pytest.mark.parametrize("new_window", [16, 8, 32])
def test_the_window_survives_a_checkpoint(new_window):
    """A resume with the same window decides exactly as the uninterrupted run; another window keeps the newest
    steps (train.skip_window is a recipe key, so this needs checkpoint.allow_changes)."""
    losses, norms = noisy_run(80, seed=3)
    whole = run_skipper(StepSkipper(16, 3.0, "cpu"), losses, norms)
    first = StepSkipper(16, 3.0, "cpu")
    run_skipper(first, losses[:50], norms[:50])
    resumed = StepSkipper(new_window, 3.0, "cpu")
    resumed.load_state_dict(first.state_dict())
    got = run_skipper(resumed, losses[50:], norms[50:])
    if new_window == 16:
        assert got == whole[50:]
    else:  # the reference on the newest finite steps the saved window holds (at most new_window), then on
        finite = [(loss, n) for loss, n in zip(losses[:50], norms[:50], strict=True) if math.isfinite(loss + n)]
        kept = finite[-min(16, new_window) :]
        ref = reference_decisions([x for x, _ in kept] + losses[50:], [n for _, n in kept] + norms[50:], new_window, 3)
        assert got == ref[len(kept) :]
    assert int(resumed.total) == int(first.total) + sum(got)

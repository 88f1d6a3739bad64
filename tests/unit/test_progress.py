"""The step line's train tok/s and ETA (console.Progress) on a fake clock, driven the way the trainer's loop drives it:
validation and checkpoint time is measured apart, so the rate is the training rate and the ETA counts down
without jumping at a validation step (issue 24: ETA 5 min 39 s at step 30, 16 min 29 s at step 32)."""

from __future__ import annotations

import pytest

from pipeline.console import Progress

STEP_SECONDS, VALIDATION_SECONDS, CHECKPOINT_SECONDS = 0.5, 1.2, 2.0
TOKENS, TOTAL, LOG_EVERY, VAL_EVERY, CKPT_EVERY = 2048, 40, 2, 8, 20


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def drive() -> tuple[dict[int, object], float]:
    """A 40-step run: log every 2, validate every 8 (and at the end), checkpoint every 20; each step 0.5 s,
    each validation 1.2 s, each checkpoint 2 s. Returns the pace of every line and when the run ended."""
    clock = FakeClock()
    validations = [s for s in range(1, TOTAL + 1) if s % VAL_EVERY == 0 or s == TOTAL]
    checkpoints = [s for s in range(1, TOTAL + 1) if s % CKPT_EVERY == 0]
    # 8 steps' tokens of validation: a forward-only estimate of 8 x 0.5 / 3 = 1.33 s before it is measured
    progress = Progress(TOTAL, 0, TOKENS, validations, checkpoints, 8 * TOKENS, clock=clock)
    lines = {}
    for step in range(1, TOTAL + 1):
        clock.now += STEP_SECONDS
        progress.trained(STEP_SECONDS)  # what the loop measured for the step
        if step in validations:
            with progress.aside("validation"):
                clock.now += VALIDATION_SECONDS
        if step % LOG_EVERY == 0 or step in validations:
            lines[step] = progress.pace(step)
        if step in checkpoints:
            with progress.aside("checkpoint"):
                clock.now += CHECKPOINT_SECONDS
    return lines, clock.now


def test_rate_is_the_training_rate_and_the_eta_does_not_jump_at_validation():
    lines, end = drive()
    assert all(p.train_tokens_per_sec == pytest.approx(TOKENS / STEP_SECONDS) for p in lines.values())
    steps = list(lines)
    rises = [later for earlier, later in zip(steps, steps[1:]) if lines[later].eta > lines[earlier].eta]
    # a countdown: it never goes up at a validation step (the old rule, validation time counted as training
    # time, gave the jump of the issue there); it goes up once, when the first checkpoint's cost is known
    assert rises == [CKPT_EVERY + LOG_EVERY], {s: p.eta for s, p in lines.items()}
    # once a validation and a checkpoint have been measured, elapsed + ETA is exactly when the run ends
    start = 100.0
    for step, p in lines.items():
        predicted = start + p.elapsed + p.eta
        if step > CKPT_EVERY:
            assert predicted == pytest.approx(end), step
        else:  # validations estimated, then measured; the checkpoints not yet: close, and early
            assert end - 2 * CHECKPOINT_SECONDS - 1.0 < predicted < end, step


def test_no_trained_step_since_the_last_line_gives_no_pace():
    clock = FakeClock()
    progress = Progress(10, 4, TOKENS, [], [], 0, clock=clock)
    clock.now += 1.0
    assert progress.pace(4) is None
    clock.now += 1.0
    progress.trained(1.0)
    assert progress.pace(5).train_tokens_per_sec == pytest.approx(TOKENS)


def test_evals_are_timed_apart_and_counted_in_the_eta():
    """Evals every 10 steps (after the step's line) at 3 s each: the rate stays the training rate, and once
    one eval is measured elapsed + ETA is when the run ends."""
    clock = FakeClock()
    evals = [10, 20, 30, 40]
    progress = Progress(TOTAL, 0, TOKENS, [], [], 0, eval_steps=evals, eval_tokens=4 * TOKENS, clock=clock)
    lines = {}
    for step in range(1, TOTAL + 1):
        clock.now += STEP_SECONDS
        progress.trained(STEP_SECONDS)
        if step % LOG_EVERY == 0:
            lines[step] = progress.pace(step)
        if step in evals:
            with progress.aside("eval"):
                clock.now += 3.0
    assert all(p.train_tokens_per_sec == pytest.approx(TOKENS / STEP_SECONDS) for p in lines.values())
    # before the first eval: estimated as a forward pass over its tokens (4 steps' tokens / 3)
    assert lines[2].eta == pytest.approx(38 * STEP_SECONDS + 4 * 4 * STEP_SECONDS / 3)
    for step, p in lines.items():
        if step > 10:
            assert 100.0 + p.elapsed + p.eta == pytest.approx(clock.now), step


def test_the_step_line_and_perf_step_time_read_one_clock(monkeypatch):
    """The loop hands Progress what UnreadSteps measured at each read-back, so the line's train tok/s is
    tokens / perf/step_time over the same steps, whatever else the sync steps spend (here 1 s of logging
    between the read-back and the clock's restart, which neither may count)."""
    from collections import deque
    from types import SimpleNamespace

    from pipeline.train import diagnostics

    clock = FakeClock()
    monkeypatch.setattr(diagnostics.time, "perf_counter", clock)
    unread, progress = diagnostics.UnreadSteps(), Progress(8, 0, TOKENS, [], [], 0, clock=clock)
    results = []
    for step in range(1, 9):
        clock.now += STEP_SECONDS * (1 + step % 2)  # uneven steps: 1.0 s and 0.5 s
        result = SimpleNamespace(read_back=lambda: None, skipped=False, finite=True, skips_in_a_row=0, loss=1.0)
        unread.add(step, result)
        results.append(result)
        if step % 4:
            continue
        unread.read_back(deque())
        progress.trained(unread.seconds)
        pace = progress.pace(step)
        clock.now += 1.0  # the line, a checkpoint: not training
        unread.restart_clock()
        step_time = sum(r.seconds for r in results[-4:]) / 4
        assert pace.train_tokens_per_sec == pytest.approx(TOKENS / step_time) == pytest.approx(TOKENS / 0.75)

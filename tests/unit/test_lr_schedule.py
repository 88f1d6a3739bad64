"""pipeline.lr_schedule: cosine unchanged to the bit, WSD and a cooldown branch equal to their closed forms, and
the config's refusals of impossible schedules."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pipeline import config
from pipeline.config import ConfigError
from pipeline.lr_schedule import ends_annealed, lr_at, schedule_of

LR, MIN_LR = 6e-4, 6e-5
TOTAL, WARMUP, DECAY = 10_000, 250, 1_000


def cosine_before_wsd(step: int, total: int, warmup: int, lr: float, min_lr: float) -> float:
    """train.lr_at as it was before WSD (commit 9273090): the runs and resumes it made must not change."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


def test_cosine_is_bit_identical_to_the_formula_before_wsd() -> None:
    for total, warmup in ((TOTAL, WARMUP), (384, 10), (5, 0), (1, 0)):
        for step in range(total + 1):
            assert lr_at(step, total, warmup, LR, MIN_LR) == cosine_before_wsd(step, total, warmup, LR, MIN_LR)


def test_the_trainer_steps_the_same_cosine_as_before() -> None:
    cfg = config.load("configs/tiny_prism.yaml")
    layout, s = cfg.steps(1), schedule_of(cfg)
    for step in range(layout["total"]):
        assert s.at(step) == cosine_before_wsd(step, layout["total"], layout["warmup"], cfg.train.lr, cfg.train.min_lr)


SHAPES = {  # the decay's closed forms over p in (0, 1]
    "linear": lambda p: MIN_LR + (LR - MIN_LR) * (1 - p),
    "1-sqrt": lambda p: MIN_LR + (LR - MIN_LR) * (1 - np.sqrt(p)),
    "cosine": lambda p: MIN_LR + (LR - MIN_LR) * 0.5 * (1 + np.cos(np.pi * p)),
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_wsd_equals_its_closed_form_at_every_step(shape: str) -> None:
    steps = np.arange(TOTAL)
    p = (steps - (TOTAL - DECAY) + 1) / DECAY
    expected = np.where(
        steps < WARMUP, LR * (steps + 1) / WARMUP, np.where(p <= 0, LR, SHAPES[shape](np.clip(p, 0, 1)))
    )
    got = np.array([lr_at(int(s), TOTAL, WARMUP, LR, MIN_LR, "wsd", DECAY, shape) for s in steps])
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=0)
    assert got[TOTAL - DECAY - 1] == LR and got[-1] == pytest.approx(MIN_LR)  # stable until the decay, then min_lr
    assert np.all(np.diff(got[TOTAL - DECAY - 1 :]) < 0)  # each decay step lower than the one before


def tiny(*overrides: str) -> config.Config:
    return config.load("configs/tiny_prism.yaml", list(overrides))


def test_a_branch_decays_from_the_main_runs_lr_at_its_step() -> None:
    main = tiny("train.lr_schedule=wsd")
    branch = tiny(
        "train.lr_schedule=wsd",
        "cooldown.from_run_dir=runs/prism-tiny-s1234",
        "cooldown.from_step=100",
        "cooldown.decay_tokens=40960",
        "cooldown.decay_shape=linear",
    )
    a, b = schedule_of(main), schedule_of(branch)
    assert branch.steps(1)["total"] == 120 and branch.steps(1)["warmup"] == main.steps(1)["warmup"]
    assert branch.run_name == "prism-tiny-s1234-cooldown-100"
    assert [b.at(s) for s in range(100)] == [a.at(s) for s in range(100)]  # the main schedule up to the branch
    start, low = a.at(100), main.train.min_lr
    expected = [low + (start - low) * (1 - (k + 1) / 20) for k in range(20)]
    np.testing.assert_allclose([b.at(100 + k) for k in range(20)], expected, rtol=1e-12)


def test_a_branch_of_a_cosine_run_starts_at_the_cosine_lr() -> None:
    branch = tiny("cooldown.from_run_dir=r", "cooldown.from_step=200", "cooldown.decay_tokens=2048")
    s = schedule_of(branch)
    assert s.at(199) == cosine_before_wsd(199, 384, 10, 2e-3, 2e-4)  # main schedule before the branch
    assert s.at(200) == pytest.approx(branch.train.min_lr)  # one decay step: straight to min_lr


def test_a_point_is_annealed_at_its_schedules_end_whatever_the_schedule() -> None:
    """ends_annealed, the rule compare's annealed table and the scaling points read: the last step of a cosine
    main run (its LR there is within one step of min_lr), of a WSD main run (its own decay) and of a branch."""
    branch = tiny("train.lr_schedule=wsd", "cooldown.from_step=100", "cooldown.decay_tokens=40960")
    for cfg, end in ((tiny(), 384), (tiny("train.lr_schedule=wsd"), 384), (branch, 120)):
        assert [ends_annealed(cfg, step) for step in (end - 1, end)] == [False, True]
        s = schedule_of(cfg)
        assert s.at(end - 1) == pytest.approx(cfg.train.min_lr, rel=1e-3) and s.at(end - 1) < s.at(end - 2)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.decay_fraction=0"], "train.decay_fraction: 0.0 must be in (0, 1]"),
        (["train.decay_fraction=1.5"], "train.decay_fraction: 1.5 must be in (0, 1]"),
        (["train.lr_schedule=wsd", "train.decay_fraction=1"], "exceeds the 384 steps of the run"),
        (["train.lr_schedule=linear"], "train.lr_schedule"),
        (["train.decay_shape=sqrt"], "train.decay_shape"),
        (["cooldown.from_step=10"], "cooldown.decay_tokens: a cooldown branch needs"),
        (["cooldown.from_run_dir=r"], "cooldown.from_run_dir: a cooldown branch needs"),
        (["cooldown.from_run_dir=r", "cooldown.from_step=0", "cooldown.decay_tokens=2048"], "from_step: 0 must be"),
        (["cooldown.from_run_dir=r", "cooldown.from_step=5", "cooldown.decay_tokens=100"], "less than one step"),
    ],
)
def test_impossible_schedules_are_refused_in_one_line(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        tiny(*overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_cosine_main_runs_identity_ignores_the_wsd_and_cooldown_keys() -> None:
    """result_hash ("already finished" in demo and study): keys that change nothing for a cosine main run stay out
    of it, so runs finished before they existed are still found; a WSD run and a branch are runs of their own."""
    from pipeline.config import result_hash

    cosine = result_hash(tiny())
    assert result_hash(tiny("train.decay_shape=linear", "train.decay_fraction=0.3")) == cosine
    assert result_hash(tiny("train.lr_schedule=wsd")) != cosine
    branch = ("cooldown.from_step=100", "cooldown.decay_tokens=40960")
    assert result_hash(tiny(*branch)) != cosine
    assert result_hash(tiny(*branch, "train.decay_shape=linear")) != result_hash(tiny(*branch))  # its decay's shape

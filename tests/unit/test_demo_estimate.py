"""The demo's estimate comes from the arms' own first step lines (a fake clock here), not from a constant:
arms side by side take as long as the slower one, arms in turn add up, and validation passes still ahead count."""

from __future__ import annotations

import pytest

from pipeline import config, demo
from pipeline.console import duration
from pipeline.eval.plan import aside_cost


def feed(timing, monkeypatch, lines):
    for t, arm, line in lines:
        monkeypatch.setattr(demo.time, "monotonic", lambda t=t: t)
        if line is None:
            timing.started(arm)
        else:
            match = demo.STEP_LINE.match(line)
            timing.step(arm, int(match.group(1)), int(match.group(2)))


@pytest.mark.parametrize("at_once", [2, 1])
def test_estimate_is_measured_from_the_first_steps(at_once, monkeypatch, capsys):
    cfg = config.load("configs/tiny_prism.yaml")
    total = cfg.steps(1)["total"]
    timing = demo.ArmTiming(cfg, t0=0.0, arms=2, at_once=at_once)
    # uniform: launched at 5 s, step 1 at 25 s, step 10 at 34 s (1 s a step); prism 2 s a step
    lines = [
        (5.0, "uniform", None),
        (25.0, "uniform", f"step      1/{total} | loss 9.0"),
        (34.0, "uniform", f"step     10/{total} | x"),
    ]
    if at_once == 2:
        lines += [
            (5.0, "prism", None),
            (26.0, "prism", f"step      1/{total} | x"),
            (44.0, "prism", f"step     10/{total} | x"),
        ]
    feed(timing, monkeypatch, lines)
    out = capsys.readouterr().out
    # The share of validations and evals is eval_plan's answer (tested there), read here, not re-derived.
    aside = aside_cost(cfg, total)["share"]
    assert 0 < aside < 0.5  # the preset validates two sets and evals during the run: they must count
    if at_once == 2:  # side by side: the slower arm (2 s a step) decides
        left, now = (total - 10) * 2.0 / (1 - aside), 44.0
    else:  # in turn: uniform's rest, then prism from launch (uniform's start-up of 20 s + its steps)
        left, now = (total - 10) / (1 - aside) + 20.0 + total / (1 - aside), 34.0
    assert out.count("estimate from the first steps") == 1
    assert f"training done in about {duration(left)}, the demo in about {duration(now + left)} in all" in out

"""pipeline.verdict.annealed: branches grouped into annealed points per budget, Δ paired by seed as the main table
does, and nothing for an experiment without finished branches."""

from __future__ import annotations

import math

import pytest

from pipeline import statistics
from pipeline.compare import RunSeries, arm_difference
from pipeline.verdict import annealed


def branch(arm: str, seed: int, step: int, tokens: float, loss: float, status: str = "FINISHED") -> RunSeries:
    schedule = "12x8" if arm == "uniform" else "3x2,6x2,12x4"
    val = [(step + 1, tokens - 2048, loss + 0.5), (step + 4, tokens, loss)]
    return RunSeries(
        f"{arm}-{seed}-{step}", f"{arm}-tiny-s{seed}-cooldown-{step}", arm, "tiny", str(seed), status, val, 1000.0,
        schedule=schedule, data_order="d", branch_step=step,
    )  # fmt: skip


BRANCHES = [
    branch("uniform", 1, 36, 81920, 5.10),
    branch("uniform", 2, 36, 81920, 5.20),
    branch("prism", 1, 36, 81920, 5.00),
    branch("prism", 2, 36, 81920, 5.06),
    branch("uniform", 1, 72, 163840, 4.80),
    branch("prism", 1, 72, 163840, 4.75),
]


def test_one_row_per_budget_and_arm_with_the_seed_paired_delta():
    rows = annealed.summarize(BRANCHES, arm_difference)
    assert [(r["tokens"], r["arm"]) for r in rows] == [
        (81920, "uniform"),
        (81920, "prism"),
        (163840, "uniform"),
        (163840, "prism"),
    ]
    prism = rows[1]
    want = statistics.paired_difference([5.10, 5.20], [5.00, 5.06])
    assert prism["delta_test"] == "paired" and prism["delta_vs_uniform"] == pytest.approx(want.mean)
    assert (prism["delta_ci95_low"], prism["delta_ci95_high"]) == pytest.approx((want.low, want.high))
    assert prism["annealed_val_loss_mean"] == pytest.approx(5.03) and prism["branch_steps"] == "36"
    assert math.isnan(rows[0]["delta_vs_uniform"])  # the uniform row carries no Δ
    assert rows[3]["delta_vs_uniform"] == pytest.approx(-0.05) and math.isnan(rows[3]["delta_ci95_low"])  # 1 seed


def test_the_table_names_each_budget_and_an_unfinished_branch_is_left_out(tmp_path):
    text = annealed.markdown(annealed.summarize(BRANCHES, arm_difference))
    assert "| tiny | 81,920 | prism | 3x2,6x2,12x4 | 36 | 2 | 5.0300 ± 0.0424 |" in text
    assert "| tiny | 163,840 | uniform | 12x8 | 72 | 1 | 4.8000 ± n/a |" in text
    running = branch("prism", 3, 144, 327680, 4.5, status="RUNNING")
    unused = "sqlite:///nowhere.db"  # no finished branch: the main runs' configs are never read
    assert annealed.section([running], [], tmp_path, lambda fig, path: path, arm_difference, unused) == (
        "",
        [],
    )  # no plot either


def test_a_main_runs_own_decay_is_an_annealed_point_at_its_full_tokens():
    """Beside its branches, each main run's final point (annealed by its own decay) is a row at its full tokens,
    labelled as the main run's, with Δ paired by seed like the branches'."""
    mains = []
    for arm, seed, loss in (("uniform", 1, 4.50), ("uniform", 2, 4.56), ("prism", 1, 4.40), ("prism", 2, 4.48)):
        run = branch(arm, seed, 0, 655360, loss)
        run.branch_step = None  # a main run: compare.load_runs leaves its branch_step unset
        mains.append(run)
    rows = annealed.summarize(BRANCHES + mains, arm_difference)
    ends = [r for r in rows if r["tokens"] == 655360]
    assert [(r["arm"], r["branch_steps"], r["seeds"]) for r in ends] == [
        ("uniform", annealed.MAIN_RUN, "1,2"),
        ("prism", annealed.MAIN_RUN, "1,2"),
    ]
    assert ends[1]["delta_test"] == "paired" and ends[1]["delta_vs_uniform"] == pytest.approx(-0.09)
    assert len(rows) == 6 and all(r["branch_steps"] != annealed.MAIN_RUN for r in rows[:4])
    text = annealed.markdown(rows)
    assert "| tiny | 655,360 | prism | 3x2,6x2,12x4 | main run's own decay | 2 | 4.4400 ± 0.0566 |" in text

"""compare.summarize / markdown on hand-made runs: grouping by schedule, paired vs Welch, throughput, notes."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from scipy import stats

from pipeline.compare import RunSeries, data_order, markdown, shared_machine, summarize, throughput

ORDER = "ds|2048|4|256"


def run(arm, seed, final, schedule="12x8", order=ORDER, host="h", span=(0.0, 1.0), tps=100.0):
    return RunSeries(
        f"id-{arm}-{schedule}-{seed}",
        f"{arm}-tiny-s{seed}-{schedule}",
        arm,
        "tiny",
        str(seed),
        "FINISHED",
        [(1, 2048.0, final + 1.0), (2, 4096.0, final)],
        tps,
        {5.0: (2048.0, 1.0)},
        schedule=schedule,
        data_order=order,
        host=host,
        span=span,
    )


def spans(i):  # one run after another: no overlap
    return (10.0 * i, 10.0 * i + 5.0)


def test_each_prism_schedule_gets_its_own_row_and_its_own_difference():
    uni = [5.80, 5.84, 5.79]
    a = [5.70, 5.75, 5.71]  # schedule 3x2,6x2,12x4
    b = [5.90, 5.88, 5.95]  # schedule 6x4,12x4
    runs = [run("uniform", s, v, span=spans(s)) for s, v in zip((1, 2, 3), uni)]
    runs += [run("prism", s, v, "3x2,6x2,12x4", span=spans(3 + s)) for s, v in zip((1, 2, 3), a)]
    runs += [run("prism", s, v, "6x4,12x4", span=spans(6 + s)) for s, v in zip((1, 2, 3), b)]
    rows = summarize(runs)
    assert [(r["arm"], r["schedule"], r["runs"]) for r in rows] == [
        ("uniform", "12x8", 3),
        ("prism", "3x2,6x2,12x4", 3),
        ("prism", "6x4,12x4", 3),
    ]
    for row, values in ((rows[1], a), (rows[2], b)):
        ref = stats.ttest_rel(values, uni)  # same seeds, same data order: paired by seed
        assert row["delta_test"] == "paired"
        assert row["delta_vs_uniform"] == pytest.approx(sum(values) / 3 - sum(uni) / 3)
        assert row["delta_p_value"] == pytest.approx(ref.pvalue, rel=1e-8)
        lo, hi = ref.confidence_interval(0.95)
        assert (row["delta_ci95_low"], row["delta_ci95_high"]) == (pytest.approx(lo), pytest.approx(hi))
        assert isinstance(row["seeds_needed_80pct_power"], int)
    table = markdown(rows, "x", shared_machine(runs))
    assert "| tiny | prism | 3x2,6x2,12x4 | 3 |" in table and "| tiny | prism | 6x4,12x4 | 3 |" in table
    assert "(paired)" in table and "overlapped" not in table


def test_other_data_order_or_other_seeds_fall_back_to_welch():
    uni = [run("uniform", s, v) for s, v in ((1, 5.8), (2, 5.9), (3, 5.85))]
    prism = [run("prism", s, v, "3x2,6x2,12x4", order="other|2048|4|256") for s, v in ((1, 5.7), (2, 5.75), (3, 5.8))]
    row = summarize(uni + prism)[1]
    ref = stats.ttest_ind([5.7, 5.75, 5.8], [5.8, 5.9, 5.85], equal_var=False)
    assert row["delta_test"] == "welch" and row["delta_p_value"] == pytest.approx(ref.pvalue, rel=1e-8)
    prism = [run("prism", s, v, "3x2,6x2,12x4") for s, v in ((4, 5.7), (5, 5.75), (6, 5.8))]
    assert summarize(uni + prism)[1]["delta_test"] == "welch"


def test_one_seed_reports_the_difference_without_an_interval():
    rows = summarize([run("uniform", 1, 5.8), run("prism", 1, 5.9, "3x2,6x2,12x4")])
    assert rows[1]["delta_vs_uniform"] == pytest.approx(0.1) and math.isnan(rows[1]["delta_p_value"])
    assert "+0.1000 [needs ≥ 2 seeds]" in markdown(rows, "x")


def test_throughput_leaves_out_the_first_step_and_overlap_is_noted():
    m = lambda step, ms, tokens: SimpleNamespace(step=step, timestamp=ms, value=tokens)  # noqa: E731
    # step 1 took 30 s (warm-up); then 3 steps of 1024 tokens in 2 s
    rate, span = throughput([m(1, 30_000, 1024), m(2, 30_500, 2048), m(4, 32_000, 4096), m(2, 30_400, 2048)])
    assert rate == pytest.approx(3 * 1024 / 2.0) and span == (30.0, 32.0)
    assert math.isnan(throughput([m(1, 1, 1)])[0])
    # a stop after step 4 and a resume 10 min later: the gap counts neither tokens nor time
    resumed = [m(1, 0, 1024), m(2, 1000, 2048), m(3, 2000, 3072), m(4, 3000, 4096), m(5, 603_000, 5120)]
    assert throughput([*resumed, m(6, 604_000, 6144)])[0] == pytest.approx(1024.0)
    runs = [run("uniform", 1, 5.8, span=(0, 10)), run("prism", 1, 5.7, "3x2", span=(5, 15))]
    assert shared_machine(runs) == sorted(r.name for r in runs)
    assert "overlapped in time" in markdown(summarize(runs), "x", shared_machine(runs))
    runs[1].host = "other"
    assert shared_machine(runs) == []


def test_compact_token_ticks():
    from pipeline.compare import compact_tokens

    assert [compact_tokens(x) for x in (0, 950, 200_000, 1_500_000, 2.88e9)] == ["0", "950", "200k", "1.5M", "2.88B"]


def test_plots_one_curve_per_schedule_with_measured_points(tmp_path):
    from pipeline.compare import plot

    runs = [run("uniform", s, 5.8 + s / 100) for s in (1, 2)]
    runs += [run("prism", s, 5.7 + s / 100, "3x2,6x2,12x4") for s in (1, 2)]
    runs += [run("prism", s, 5.9 + s / 100, "6x4,12x4") for s in (1, 2)]
    paths = plot(runs, tmp_path)
    assert [p.name for p in paths] == ["val_loss_vs_tokens_tiny.png", "delta_val_loss_vs_tokens_tiny.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in paths)


def test_the_data_parallel_size_is_part_of_the_data_order():
    """pipeline.data deals shards to DP ranks: the same seed at DP 1 and DP 2 sees other batches, so is not a pair."""
    params = {"data.dataset_dir": "ds", "train.batch_tokens": "2048", "train.micro_batch_size": "4"}
    params["model.seq_len"] = "256"
    one, two = data_order({**params, "parallel/dp_size": "1"}), data_order({**params, "parallel/dp_size": "2"})
    assert one != two and one == data_order({**params, "parallel/dp_size": "1"})
    uni = [run("uniform", s, v, order=one) for s, v in ((1, 5.8), (2, 5.9), (3, 5.85))]
    prism = [run("prism", s, v, "3x2,6x2,12x4", order=two) for s, v in ((1, 5.7), (2, 5.75), (3, 5.8))]
    assert summarize(uni + prism)[1]["delta_test"] == "welch"
    prism = [run("prism", s, v, "3x2,6x2,12x4", order=one) for s, v in ((1, 5.7), (2, 5.75), (3, 5.8))]
    assert summarize(uni + prism)[1]["delta_test"] == "paired"


def test_a_resume_cannot_change_the_data_order_compare_pairs_by():
    """compare logs each run's data order once, at its start: a resume must refuse every key of it (the DP
    size is the exception the trainer names in params_changed_on_resume)."""
    from pipeline.config.resume_keys import DATA_ORDER_KEYS, EXECUTION_ONLY_KEYS, MODEL_OR_DATA_KEYS

    def covered(key: str, keys: tuple[str, ...]) -> bool:
        return any(key == k or key.startswith(k + ".") for k in keys)

    assert all(covered(k, MODEL_OR_DATA_KEYS) and not covered(k, EXECUTION_ONLY_KEYS) for k in DATA_ORDER_KEYS)

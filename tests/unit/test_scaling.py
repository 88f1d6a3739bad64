"""verdict.scaling on hand-made runs: N from each run's config, the checks before a fit, and the report files."""

from __future__ import annotations

import csv
import io
from pathlib import Path

import pytest

from pipeline import config, model_size
from pipeline.compare import RunSeries
from pipeline.config import ConfigError
from pipeline.verdict import scaling

ROOT = Path(__file__).resolve().parents[2]
WIDTHS = (64, 128, 192)


def ladder(arm: str, width: int, *overrides: str) -> config.Config:
    return config.load(ROOT / f"configs/ladder/{arm}_w{width}.yaml", list(overrides))


def series(cfg: config.Config, seed: int, loss: float, tokens: float = 4096.0, last: int | None = None) -> RunSeries:
    """A finished run whose last validation is at step ``last`` (default its schedule's end: an annealed point)."""
    last = cfg.steps(1)["total"] if last is None else last
    return RunSeries(
        f"id-{cfg.run_name}-{seed}",
        f"{cfg.run.arm}-{cfg.run.scale}-s{seed}",
        cfg.run.arm,
        cfg.run.scale,
        str(seed),
        "FINISHED",
        [(last - 1, tokens / 2, loss + 1.0), (last, tokens, loss)],
        1000.0,
    )


def test_each_point_has_the_parameter_count_of_its_logged_config():
    runs = [(series(ladder(arm, w), 1, 6.0), ladder(arm, w), False) for w in WIDTHS for arm in ("uniform", "prism")]
    branch_cfg = ladder("prism", 64)
    runs.append((series(branch_cfg, 1, 5.5, tokens=8192.0), branch_cfg, True))
    points = scaling.make_points(runs)
    assert [p.N for p in points] == [model_size.parameter_count(cfg) for _, cfg, _ in runs]
    sizes = sorted({p.N for p in points})
    assert len(sizes) == 3 and sizes[0] < sizes[1] < sizes[2]  # both arms of a width: one N (Prism is neutral)
    assert (points[-1].branch, points[-1].D, points[-1].loss) == (True, 8192.0, 5.5)
    assert all(not m["arm"] == "prism" or m["tokens"] == 4096.0 for m in scaling.measured(points))  # no branch


def test_only_a_final_point_at_the_schedules_end_is_a_point():
    """final_point_annealed, the one rule: a main run of either schedule, or a branch, whose last validation is
    at its schedule's end is annealed; a finished run whose last validation came earlier is left out."""
    cosine = ladder("uniform", 64)
    wsd = ladder("prism", 64, "train.lr_schedule=wsd")
    total = cosine.steps(1)["total"]
    branch = ladder(
        "prism", 64, "train.lr_schedule=wsd", f"cooldown.from_step={total // 2}", "cooldown.decay_tokens=4096"
    )
    early = series(wsd, 2, 5.9, last=total - 1)
    assert [scaling.final_point_annealed(series(c, 1, 6.0), c) for c in (cosine, wsd, branch)] == [True] * 3
    end = branch.steps(1)["total"]  # a branch ends at its own decay's end, before its main run's
    assert end < total and not scaling.final_point_annealed(series(branch, 1, 6.0, last=end - 1), branch)
    assert not scaling.final_point_annealed(early, wsd)
    points = scaling.make_points(
        [(series(cosine, 1, 6.0), cosine, False), (early, wsd, False), (series(wsd, 1, 5.8), wsd, False)]
    )
    assert [(p.arm, p.seed) for p in points] == [("uniform", "1"), ("prism", "1")]


@pytest.mark.parametrize(
    "key, other",
    [("data.tokenizer", "/elsewhere/gpt2.json"), ("data.dataset_dir", "/elsewhere/fineweb"), ("model.seq_len", "128")],
)
def test_sizes_on_other_data_are_refused_naming_both_values(key, other):
    small, large = ladder("uniform", 64), ladder("uniform", 192, f"{key}={other}")
    with pytest.raises(ConfigError, match="mixed") as e:
        scaling.make_points([(series(small, 1, 6.0), small, False), (series(large, 1, 5.0), large, False)])
    mine = str(config.resume_keys.flatten(small.to_dict())[key])
    assert mine in str(e.value) and other in str(e.value) and "\n" not in str(e.value)


def test_a_larger_batch_at_a_larger_size_is_one_ladder():
    small, large = ladder("uniform", 64), ladder("uniform", 192, "train.batch_tokens=4096", "train.micro_batch_size=8")
    points = scaling.make_points([(series(small, 1, 6.0), small, False), (series(large, 1, 5.0), large, False)])
    assert len(points) == 2


def law_points(sizes, seeds=(1, 2), prism_gain=0.97) -> list[scaling.Point]:
    """Final losses drawn from L = 2 + 400·N^-0.35 (Prism's excess over E scaled by ``prism_gain``), seed noise."""
    import numpy as np

    rng = np.random.default_rng(0)
    points = []
    for n in sizes:
        for arm, gain in (("uniform", 1.0), ("prism", prism_gain)):
            for seed in seeds:
                loss = 2.0 + gain * 400.0 * n**-0.35 + rng.normal(0, 0.003)
                points.append(scaling.Point(arm, f"n{n}", str(seed), n, 0.06 * n, loss, 1000.0, f"{arm}{n}{seed}"))
    return points


def test_a_fit_needs_both_arms_and_enough_sizes():
    only_uniform = [p for p in law_points([1e6, 3e6, 1e7]) if p.arm == "uniform"]
    with pytest.raises(ConfigError, match="needs both arms"):
        scaling.fit(only_uniform)
    with pytest.raises(ConfigError, match=r"uniform 2 size\(s\)") as e:
        scaling.fit(law_points([1e6, 3e6]))
    assert "3" in str(e.value)  # what the fit needs


def test_the_table_and_csv_on_points_from_a_known_law():
    """(The plot and the files: tests/integration/test_scaling_ladder.py, on real runs.)"""
    points = law_points([1e6, 3e6, 1e7])
    verdict = scaling.fit(points)
    table = scaling.markdown(points, verdict, "ladder")
    rows = list(csv.DictReader(io.StringIO(scaling.to_csv(verdict["rows"]))))
    assert [float(r["N"]) for r in rows] == [1e6, 3e6, 1e7]
    assert all(float(r["gap"]) < 0 and float(r["k"]) > 1 for r in rows)  # Prism's excess loss is 3 % lower
    assert all(float(r["k_low"]) <= float(r["k"]) <= float(r["k_high"]) for r in rows)  # two seeds: an interval
    assert verdict["form"] == "L(N)" and "| 3,000,000 | uniform | 2 |" in table and "prism: L = " in table
    assert "| 1,000,000 | " in table.split("| N (params) | gap")[1]  # one verdict row per size
    one_seed = scaling.markdown(
        law_points([1e6, 3e6, 1e7], seeds=(1,)), scaling.fit(law_points([1e6, 3e6, 1e7], seeds=(1,))), "x"
    )
    assert "n/a: needs ≥ 2 seeds per size" in one_seed


def test_a_study_may_run_a_ladder_of_scales_on_one_dataset():
    from pipeline.study import study_runs

    presets = [str(ROOT / f"configs/ladder/{arm}_w{w}.yaml") for w in WIDTHS for arm in ("uniform", "prism")]
    runs = study_runs(presets, [1], [])
    assert [r.cfg.experiment for r in runs[::2]] == [f"prism-ladder-w{w}" for w in WIDTHS]
    with pytest.raises(ConfigError, match="one dataset with one tokenizer"):  # the paper's 124m reads another
        study_runs([presets[0], str(ROOT / "configs/prism_124m.yaml")], [1], [])


def test_cooldown_branches_add_token_counts_and_the_fit_becomes_two_dimensional():
    import dataclasses

    def data_term(D):  # B·D^-β: what more tokens remove
        return 50.0 * D**-0.3

    size_only = law_points([10**6, 10**7])
    main = [dataclasses.replace(p, loss=p.loss + data_term(p.D)) for p in size_only]
    branches = [dataclasses.replace(p, D=p.D / 2, loss=p.loss + data_term(p.D / 2), branch=True) for p in size_only]
    verdict = scaling.fit(main + branches)
    assert verdict["form"] == "L(N,D)" and verdict["fits"]["prism"].beta is not None
    table = scaling.markdown(main + branches, verdict, "x")
    assert "8 annealed cooldown-branch point(s)" in table
    assert [m["seeds"] for m in scaling.measured(main + branches)] == [2, 2, 2, 2]  # the main runs only


def test_the_paper_presets_are_one_ladder():
    # 124M once read sample/10BT and 354M/757M sample/100BT: their val losses came from other validation
    # tokens, and `prism scaling` refused the paper's own three sizes.
    runs = []
    for scale in ("124m", "354m", "757m"):
        cfg = config.load(ROOT / f"configs/prism_{scale}.yaml", [])
        runs.append((series(cfg, 1, 3.0), cfg, False))
    points = scaling.make_points(runs)
    assert [p.N for p in points] == sorted(p.N for p in points)

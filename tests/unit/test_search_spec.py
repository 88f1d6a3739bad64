"""`prism search` specs: every bad field is one line with the YAML line and column; rungs and the dry run's
token count follow the spec."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline import schedule, search
from pipeline.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]
PRISM = ROOT / "configs" / "tiny_prism.yaml"
GOOD = f"""config: {PRISM}
space:
  schedules: all-valid
rungs: {{min_tokens: 4096, reduction_factor: 2, full_tokens: 16384}}
trials: 8
"""


def _load(tmp_path: Path, text: str) -> search.SearchSpec:
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    return search.load_spec(path)


@pytest.mark.parametrize(
    "text, where, want",
    [
        ("config: [a\n", "", "not valid YAML at line 2"),
        (GOOD + "trails: 3\n", ":6:1", "unknown key 'trails'"),
        ("space: {schedules: all-valid}\n", "", "config is missing"),
        (GOOD.replace(str(PRISM), "configs/nope.yaml"), ":1:9", "config='configs/nope.yaml': no such YAML"),
        (GOOD.replace("tiny_prism", "tiny_uniform"), ":1:9", "needs a prism-arm config"),
        (GOOD.replace("all-valid", "4x8"), ":3:14", "space.schedules='4x8'"),
        (GOOD.replace("all-valid", '["3x2,6x2,12x4", "5x8"]'), ":3:14", "'5x8' does not fit the base config"),
        (GOOD.replace("all-valid", '["3x2,6x2,12x4", "3x2,6x2,12x4"]'), ":3:14", "lists a schedule twice"),
        (GOOD.replace("all-valid", "{stages: 9}"), ":3:14", "no valid schedule"),
        (GOOD.replace("all-valid", "{depth: 3}"), ":3:15", "unknown filter 'depth'"),
        (GOOD.replace("all-valid", "{stages: two}"), ":3:23", "space.schedules.stages='two'"),
        (GOOD.replace("16384}", "12288}"), ":4:61", "min_tokens x reduction_factor^k"),
        (GOOD.replace("4096,", "4000,"), ":4:21", "whole number of steps"),
        (GOOD.replace("reduction_factor: 2", "reduction_factor: 1"), ":4:45", "rungs.reduction_factor=1"),
        (GOOD.replace("min_tokens: 4096, ", ""), ":4:8", "rungs.min_tokens is missing"),
        (GOOD.replace("all-valid\n", "all-valid\n  lr: {low: 0.01, high: 0.001}\n"), ":4:7", "low must be below high"),
        (GOOD.replace("trials: 8", "trials: 99"), ":5:9", "has 26 schedules"),
        (GOOD + "sampler: bayes\n", ":6:10", "sampler='bayes'"),
        (GOOD + "pruner: median\n", ":6:9", "pruner='median'"),
        (GOOD + "executor: pbs\n", ":6:11", "executor='pbs'"),
        (GOOD + "slurm: {nodes: 0}\n", ":6:16", "slurm.nodes=0"),
        (GOOD + "concurrency: 0\n", ":6:14", "concurrency=0"),
        (GOOD + "confirm: {top_k: 9}\n", ":6:18", "cannot exceed trials=8"),
        (GOOD + "confirm: {best: 2}\n", ":6:11", "unknown key confirm.best"),
        (GOOD + "overrides: {train.lr: -1}\n", ":6:12", "the base config does not load"),
    ],
)
def test_bad_spec_is_one_line_naming_the_place(tmp_path, text, where, want):
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, text)
    message = str(err.value)
    assert "\n" not in message and want in message, message
    assert message.startswith(f"{tmp_path / 'spec.yaml'}{where}: "), message


def test_schedules_filters_and_rungs(tmp_path):
    spec = _load(tmp_path, GOOD.replace("all-valid", "{stages: 3, min_heads: [2, 3]}").replace("trials: 8", ""))
    assert spec.schedules and all(len(schedule.stages(schedule.parse(s))) == 3 for s in spec.schedules)
    assert {min(schedule.parse(s)) for s in spec.schedules} == {2, 3}
    assert spec.trials == len(spec.schedules)  # the grid: each schedule once by default
    assert spec.rungs.points == [4096, 8192, 16384]
    assert search.val_every(spec) == 2  # gcd(val_every 32, the first rung's 2 steps of 2048): a val at every rung


def test_dry_run_counts_tokens_against_the_grid_and_gpu_hours_from_plan(tmp_path):
    spec = _load(tmp_path, GOOD)
    # 8 trials, eta 2: 4 stop at 4096, 2 at 8192, 2 reach 16384
    assert search.expected_tokens(spec) == 4 * 4096 + 2 * 8192 + 2 * 16384
    text = search.dry_run(spec, mfu=0.5, peak_flops=1e9)  # a slow "GPU", so the hours print unrounded to 0
    assert "26 schedules" in text and "4,096 -> 8,192 -> 16,384 tokens (2 / 4 / 8 steps)" in text
    assert "65,536 expected" in text and "26 x 16,384 = 425,984 (15%)" in text
    from pipeline.model_size import flops_per_token

    hours = flops_per_token(spec.base) * 65_536 / (0.5 * 1e9) / 3600
    grid_hours = hours * 425_984 / 65_536
    assert f"search ~{hours:,.1f}, full grid {grid_hours:,.1f} at MFU 50%" in text, text


def test_pruner_key_picks_optunas_pruner_on_the_spec_rungs(tmp_path):
    import optuna

    asha = search.make_pruner(_load(tmp_path, GOOD))
    assert isinstance(asha, optuna.pruners.SuccessiveHalvingPruner)
    assert (asha._min_resource, asha._reduction_factor) == (4096, 2)
    hyperband = search.make_pruner(_load(tmp_path, GOOD + "pruner: hyperband\n"))
    assert isinstance(hyperband, optuna.pruners.HyperbandPruner)
    assert (hyperband._min_resource, hyperband._max_resource, hyperband._reduction_factor) == (4096, 16384, 2)


@pytest.mark.parametrize("alive", [True, False])
def test_a_trial_is_pruned_only_while_its_run_trains(tmp_path, monkeypatch, alive):
    """A trial the pruner would stop is pruned and signalled while its run trains; a run that had already
    ended when the driver first looked (its driver was down) has spent its budget: its rungs are reported
    and it completes by how it ended, rather than being called pruned after it finished."""
    import optuna
    from optuna.trial import TrialState

    from pipeline.runs.outcome import EXIT_FILE
    from pipeline.tracking.journal import Journal

    spec = _load(tmp_path, GOOD + f"folder: {tmp_path / 'search'}\nexecutor: local\n")
    driver = search.Driver(spec, resume=False, say=lambda *_: None)
    stopped: list[str] = []

    class Launcher:  # the run's process, as the driver sees it
        def alive(self, rec):
            return alive

        def stop(self, rec):
            stopped.append(rec["key"])

        def describe(self, rec):
            return "a stub"

    driver.launcher = Launcher()
    rec = driver.ask()
    rec.update(status="running", handle={"pid": 0})
    batch, full_step = spec.base.train.batch_tokens, spec.rungs.full_tokens // spec.base.train.batch_tokens
    journal = Journal(rec["checkpoint_dir"])
    for tokens in spec.rungs.points:
        journal.append({"op": "metrics", "step": tokens // batch, "metrics": {"val/loss": 5.0}})
    Path(rec["folder"]).mkdir(parents=True, exist_ok=True)
    (Path(rec["folder"]) / EXIT_FILE).write_text(f"finished {full_step}\n")
    monkeypatch.setattr(optuna.trial.Trial, "should_prune", lambda self: True)

    driver.step(rec)
    frozen = driver.study.get_trials(deepcopy=False)[rec["trial"]]
    if alive:  # pruned at the first rung
        assert set(rec["rungs"]) == {str(spec.rungs.points[0])}
        assert (rec["status"], frozen.state, set(stopped)) == ("stopping", TrialState.PRUNED, {rec["key"]})
    else:
        assert set(rec["rungs"]) == {str(t) for t in spec.rungs.points[:-1]}
        assert (rec["status"], frozen.state, frozen.value, stopped) == ("complete", TrialState.COMPLETE, 5.0, [])

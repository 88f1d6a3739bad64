"""A config's identity is what it builds: every spelling of one schedule (a list, the compact form, a preset
name) dumps and hashes the same, resumes the other's checkpoint and finds the other's finished run. The sweep
and the study resolve schedules through the config, so whatever `prism train` accepts, they accept."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline import checkpoint, config
from pipeline.checkpoint import restore
from pipeline.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny_prism.yaml"
# one schedule of the tiny Prism shape, spelled three ways (compact, a list, a mix)
SPELLINGS = ("3x2,6x2,12x4", "3,3,6,6,12,12,12,12", "3x2, 6, 6, 12x4")


def tiny(tmp_path: Path, heads: str, *extra: str) -> config.Config:
    return config.load(
        TINY,
        [
            f"run.output_dir={tmp_path}",
            f"schedule.heads={heads}",
            "train.batch_tokens=1024",
            "train.micro_batch_size=2",
            "model.seq_len=128",
            "train.train_tokens=6144",
            *extra,
        ],
    )


def test_every_spelling_of_one_schedule_dumps_and_hashes_the_same(tmp_path):
    cfgs = [tiny(tmp_path, s) for s in SPELLINGS]
    assert {c.hash() for c in cfgs} == {cfgs[0].hash()}
    assert {c.dump() for c in cfgs} == {cfgs[0].dump()}
    assert all(c.schedule.heads == "3x2,6x2,12x4" for c in cfgs)  # stored as what it builds, compact
    assert tiny(tmp_path, "3x2,6x2,12x4").hash() != tiny(tmp_path, "6x2,12x6").hash()  # another model: another id
    # a preset name is one more spelling of its schedule
    named, written = (
        config.load(ROOT / "configs" / "prism_124m.yaml", [f"schedule.heads={h}"])
        for h in ("table5-config-6", "3,3,6,6,12,12,12,12,12,12,12,12")
    )
    assert named.hash() == written.hash() and named.schedule.heads == "3x2,6x2,12x8"


def make_tag(cfg: config.Config, step: int) -> None:
    """A checkpoint tag as a run of ``cfg`` leaves it (no engine: the resume decision reads only these)."""
    tag = cfg.checkpoint_dir / checkpoint.tag_for(step)
    tag.mkdir(parents=True)
    (tag / checkpoint.MODEL_STATES).write_bytes(b"m" * 64)
    (tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"o" * 64)
    (tag / checkpoint.CONFIG_NAME).write_text(cfg.dump())
    checkpoint.write_integrity(tag, {"step": step, "tp": 1, "dp_size": 1, "world_size": 1})
    (cfg.checkpoint_dir / checkpoint.LATEST).write_text(tag.name)


@pytest.mark.parametrize("saved, resumed", [(SPELLINGS[0], SPELLINGS[1]), (SPELLINGS[1], SPELLINGS[0])])
def test_two_spellings_resume_each_other(tmp_path, saved, resumed):
    make_tag(tiny(tmp_path, saved), 3)
    assert restore.resume_point(tiny(tmp_path, resumed)).tag == "step-0000003"
    with pytest.raises(ConfigError, match=r"schedule\.heads changed"):  # a different model still is refused
        restore.resume_point(tiny(tmp_path, "6x2,12x6"))


def test_a_checkpoint_saved_with_another_spelling_compares_by_what_it_builds(tmp_path):
    """Checkpoints written before schedules were stored compactly hold the schedule as the user spelled it."""
    now = tiny(tmp_path, SPELLINGS[0]).to_dict()
    for old_spelling in ("3,3,6,6,12,12,12,12", [3, 3, 6, 6, 12, 12, 12, 12]):
        saved = {**now, "schedule": {**now["schedule"], "heads": old_spelling}}
        assert config.changed_keys(saved, now) == []
    other = {**now, "schedule": {**now["schedule"], "heads": "6x2,12x6"}}
    assert config.changed_keys(other, now) == ["schedule.heads"]


def test_a_finished_run_is_found_under_either_spelling_and_any_execution_setting(tmp_path, sqlite_store):
    from mlflow.entities import RunStatus
    from mlflow.tracking import MlflowClient

    from pipeline.runs.plan import finished_run_ids
    from pipeline.tracking.mlflow_run import run_tags
    from pipeline.tracking.store import run_uri

    first = tiny(tmp_path, SPELLINGS[0])
    client = MlflowClient(run_uri(first))
    experiment = client.create_experiment(first.experiment, artifact_location=(tmp_path / "artifacts").as_uri())
    tags = {k: v for k, v in run_tags(first).items() if k.endswith("_hash")}  # the tags a training run carries
    run = client.create_run(experiment, run_name=first.run_name, tags=tags)
    client.set_terminated(run.info.run_id, RunStatus.to_string(RunStatus.FINISHED))
    same = [tiny(tmp_path, spelling) for spelling in SPELLINGS]
    # how it ran, logged or kept: a resume accepts these, and a rerun of the demo or study finds the run
    same += [tiny(tmp_path, SPELLINGS[0], o) for o in ("train.log_every=5", "data.tasks=1", "checkpoint.keep_last=3")]
    other = [tiny(tmp_path, "6x2,12x6"), tiny(tmp_path, SPELLINGS[0], "train.lr=1e-3")]
    other += [tiny(tmp_path, SPELLINGS[0], "train.val_tokens=8192")]  # the measured val loss would differ
    assert same[-3].hash() != first.hash()  # the full config hash does see the change
    assert finished_run_ids(same + other) == [run.info.run_id] * len(same) + [None] * len(other)


# --- sweep and study resolve schedules through the config ---------------------------------------------------
def test_sweep_accepts_preset_names_and_refuses_what_the_config_refuses():
    from pipeline.runs import plan

    grid = plan.build_grid(["prism"], ["124m"], [1], ["paper-124m", "table5-config-6"])
    assert [r.schedule for r in grid] == ["3x2,6x2,8x2,12x6", "3x2,6x2,12x8"]
    assert [r.cfg.schedule.heads for r in grid] == ["3x2,6x2,8x2,12x6", "3x2,6x2,12x8"]
    # two spellings of one schedule would be one run trained twice in one folder
    with pytest.raises(ConfigError, match="3x2,6x2,8x2,12x6 more than once"):
        plan.build_grid(["prism"], ["124m"], [1], ["paper-124m", "3,3,6,6,8,8,12,12,12,12,12,12"])
    # the uniform arm's constant-schedule rule is the config's: one line, naming the arm
    with pytest.raises(ConfigError) as e:
        plan.build_grid(["uniform"], ["124m"], [1], ["paper-124m"])
    assert "\n" not in str(e.value) and "'uniform' needs a constant schedule" in str(e.value)


def test_study_sees_two_spellings_of_one_schedule_as_one_run(tmp_path):
    from pipeline import study

    paths = []
    for i, heads in enumerate(SPELLINGS[:2]):
        paths.append(tmp_path / f"arm{i}.yaml")
        paths[-1].write_text(f"base: {TINY}\nschedule:\n  heads: '{heads}'\n")
    with pytest.raises(ConfigError, match=r"two configs make the same run \(prism-tiny-s1\[3x2,6x2,12x4\]\)"):
        study.study_runs([str(p) for p in paths], [1], [f"run.output_dir={tmp_path}"])

"""Milestone checkpoints (checkpoint.keep_every_steps) on hand-made tag folders: which tags pruning keeps, what
a weights-only milestone holds, that a resume never picks one, and how readers name a milestone by its step."""

from __future__ import annotations

import json

import pytest

from pipeline import checkpoint
from pipeline.cadence import step_actions
from pipeline.checkpoint import commit, restore
from pipeline.config import ConfigError
from tests.unit.test_checkpoint_integrity import cfg_in, make_tag

OPTIM = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
# 24 steps of 1024 tokens, a checkpoint every 2 steps, a milestone every 6, the newest 2 kept
POLICY = ("train.train_tokens=24576", "checkpoint.every_steps=2", "checkpoint.keep_every_steps=6")


def save_steps(cfg, steps) -> None:
    """What the trainer's save does for each step, minus DeepSpeed: a committed tag, then prune."""
    for step in steps:
        make_tag(cfg, step)
        commit.prune(cfg.checkpoint_dir, cfg, keep=checkpoint.tag_for(step))


def kept(cfg) -> list[int]:
    return sorted(int(p.name[5:]) for p in cfg.checkpoint_dir.glob("step-*"))


def test_milestones_survive_pruning_and_keep_last_bounds_the_rest(tmp_path):
    cfg = cfg_in(tmp_path, *POLICY, "checkpoint.keep_last=2")
    save_steps(cfg, range(2, 25, 2))
    assert kept(cfg) == [6, 12, 18, 22, 24]  # 24 is the last step: a milestone too
    assert checkpoint.milestone_tags(cfg.checkpoint_dir) == [checkpoint.tag_for(s) for s in (6, 12, 18, 24)]
    for step in (6, 12, 18):  # full milestones: still resumable, record untouched but for the mark
        assert (cfg.checkpoint_dir / checkpoint.tag_for(step) / OPTIM).is_file()
        assert checkpoint.verify(cfg.checkpoint_dir / checkpoint.tag_for(step)) is None
    # without milestones the same saves keep the newest two only
    plain = cfg_in(tmp_path / "plain", "train.train_tokens=24576", "checkpoint.every_steps=2")
    save_steps(plain, range(2, 25, 2))
    assert kept(plain) == [22, 24] and checkpoint.milestone_tags(plain.checkpoint_dir) == []


def test_weights_only_milestones_keep_what_readers_need_and_are_never_resumed(tmp_path):
    cfg = cfg_in(tmp_path, *POLICY, "checkpoint.keep_last=1", "checkpoint.milestone_weights_only=true")
    save_steps(cfg, range(2, 15, 2))  # 2 .. 14
    assert kept(cfg) == [6, 12, 14]
    six = cfg.checkpoint_dir / "step-0000006"
    assert not (six / OPTIM).exists() and (six / checkpoint.MODEL_STATES).is_file()
    record = json.loads((six / checkpoint.INTEGRITY).read_text())
    assert record["weights_only"] and record["dropped"] == [OPTIM] and OPTIM not in record["files"]
    assert checkpoint.verify(six) is None  # the record is true to what the folder holds
    assert checkpoint.resolve_tag_dir(cfg.checkpoint_dir, step=6) == six  # readers name it by its step
    # the newest tag breaks: the resume passes the weights-only milestones over, and says so
    (cfg.checkpoint_dir / "step-0000014" / OPTIM).unlink()
    with pytest.raises(ConfigError, match=r"step-0000012: a weights-only milestone .* not resumable"):
        restore.resume_point(cfg)
    # a crash between the record and the deletes leaves an extra file, which the next prune removes
    (six / OPTIM).write_bytes(b"o" * 512)
    commit.prune(cfg.checkpoint_dir, cfg, keep="step-0000014")
    assert not (six / OPTIM).exists()


def test_step_actions_checkpoint_every_milestone_and_a_step_names_a_tag(tmp_path):
    cfg = cfg_in(tmp_path, *POLICY)
    actions = {s: step_actions(cfg, s, 24) for s in range(1, 25)}
    assert [s for s, a in actions.items() if a.milestone] == [6, 12, 18, 24]
    assert all(actions[s].checkpoint and actions[s].sync for s in (6, 12, 18, 24))
    make_tag(cfg, 6)
    with pytest.raises(ConfigError, match=r"no checkpoint at step 4; steps kept: 6$"):
        checkpoint.resolve_tag_dir(cfg.checkpoint_dir.parent, step=4)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "checkpoint.keep_every_steps=3",
            r"checkpoint\.keep_every_steps: 3 is not a multiple of checkpoint\.every_steps=2",
        ),
        ("checkpoint.keep_every_steps=-2", r"checkpoint\.keep_every_steps: -2 must be >= 0"),
    ],
)
def test_keep_every_steps_bad_input_names_the_key(tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        cfg_in(tmp_path, "checkpoint.every_steps=2", override)


def test_plan_states_what_milestones_cost_and_refuses_a_bad_keep_every_in_one_line(capsys):
    from pipeline.cli import main

    assert main(["plan", "configs/prism_757m.yaml", "--gpus-per-node", "8"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("milestones"))
    # 39,997 steps: 19 milestones every 2,000 and the last; 757M parameters x 2 bytes each (bf16 weights)
    assert "20 (every 2,000 steps" in line and "weights-only: 30.3 GB" in line
    assert "a full one 10.60 GB = weights 1.51 + fp32 masters 3.03 + AdamW moments 6.06" in line
    # the preset saves by the clock (checkpoint.every_minutes): every_steps is not used, any keep_every_steps holds
    by_steps = ["checkpoint.every_minutes=null", "checkpoint.keep_every_steps=1500"]
    assert main(["plan", "configs/prism_757m.yaml", *by_steps]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1 and "checkpoint.keep_every_steps: 1500 is not a multiple of checkpoint.every_steps=1000" in err[0]
    )


def test_the_preset_with_the_clock_loads_any_keep_every_and_step_actions_keeps_those_milestones():
    """The 757M preset saves by the clock (checkpoint.every_minutes): every_steps is not used, so
    keep_every_steps need not be a multiple of it (the docs' rule); every milestone still saves."""
    from pipeline import config
    from pipeline.budget import milestone_line

    cfg = config.load("configs/prism_757m.yaml", ["checkpoint.keep_every_steps=500"])
    assert cfg.checkpoint.every_minutes == 41 and cfg.checkpoint.every_steps == 1000
    assert milestone_line(cfg, 39997).split()[1] == "80"  # 79 multiples of 500 below 39,997, and the last step
    actions = {s: step_actions(cfg, s, 1600) for s in (500, 1000, 1500, 1600)}
    assert all(a.milestone and a.checkpoint for a in actions.values())
    assert not step_actions(cfg, 1200, 1600).checkpoint  # no save by steps with the clock on


def test_the_eta_and_the_plan_count_the_clocks_saves():
    """checkpoint.every_minutes: the console's ETA and `prism plan` count the saves the clock will make, at the
    measured (or planned) seconds per step, by cadence's rule: a sync step that saves for no other reason saves
    once every_minutes have passed since the last save; a milestone save restarts the clock."""
    from pipeline import cadence, config
    from pipeline.checkpoint.plan import checkpoint_plan, saves_line
    from pipeline.console import Progress

    # 60 steps, log every 5, a 1-minute clock, a milestone at 30 and the last; a step takes 4 s: 15 steps a minute
    cfg = config.load(
        "configs/tiny_prism.yaml",
        [
            "train.train_tokens=122880",
            "train.log_every=5",
            "train.val_every=1000",
            "checkpoint.every_minutes=1",
            "checkpoint.keep_every_steps=30",
        ],
    )
    syncs = {s: a for s, a in cadence.planned(cfg, 0, 60).items() if a.sync}
    assert cadence.checkpoint_steps(cfg, syncs, 4.0, 0) == [15, 30, 45, 60]  # 15, 45 by the clock
    assert cadence.checkpoint_steps(cfg, syncs, 3.0, 0) == [20, 30, 50, 60]  # the first sync step >= 60 s
    assert cadence.checkpoint_steps(cfg, syncs, None, 0) == [30, 60]  # pace unknown: by steps only

    class Clock:
        now = 0.0

        def __call__(self):
            return self.now

    clock = Clock()
    progress = Progress(
        60, 0, 1024, [], lambda per_step: cadence.checkpoint_steps(cfg, syncs, per_step, 0), 0, clock=clock
    )
    with progress.aside("checkpoint"):
        clock.now += 10.0  # a measured save: 10 s
    progress.trained(5 * 4.0)
    pace = progress.pace(5)
    assert pace.eta == 55 * 4.0 + 4 * 10.0  # the steps left and four saves, two of them by the clock

    plan = checkpoint_plan(cfg, nodes=1, tp=1, dp=1)
    line = saves_line(cfg, plan, 4.0)  # `prism plan`'s line, at the plan's seconds per step
    assert "4 in the run (2 by the clock, 2 by steps" in line, line

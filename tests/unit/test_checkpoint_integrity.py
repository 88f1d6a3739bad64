"""The integrity record and the resume decision on hand-made tag folders (no engine): which tag a resume
picks, when it falls back, when it refuses; and the config check of checkpoint.allow_changes."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline import checkpoint, config
from pipeline.checkpoint import restore
from pipeline.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def cfg_in(tmp_path: Path, *extra: str) -> config.Config:
    return config.load(
        ROOT / "configs" / "tiny_prism.yaml",
        [
            f"run.output_dir={tmp_path}",
            "train.batch_tokens=1024",
            "train.micro_batch_size=2",
            "train.train_tokens=6144",
            "model.seq_len=128",
            *extra,
        ],
    )


def make_tag(cfg: config.Config, step: int, record: bool = True) -> Path:
    tag = cfg.checkpoint_dir / checkpoint.tag_for(step)
    tag.mkdir(parents=True)
    (tag / checkpoint.MODEL_STATES).write_bytes(bytes(range(256)) * 4)
    (tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"o" * 512)
    (tag / checkpoint.CONFIG_NAME).write_text(cfg.dump())
    if record:
        checkpoint.write_integrity(tag, {"step": step, "tp": 1, "dp_size": 1, "world_size": 1})
    (cfg.checkpoint_dir / checkpoint.LATEST).write_text(tag.name)
    return tag


def test_record_lists_every_file_and_verify_finds_each_kind_of_damage(tmp_path):
    cfg = cfg_in(tmp_path)
    tag = make_tag(cfg, 3)
    assert checkpoint.verify(tag) is None
    raw = bytearray((tag / checkpoint.MODEL_STATES).read_bytes())
    raw[7] ^= 1
    (tag / checkpoint.MODEL_STATES).write_bytes(bytes(raw))
    assert "does not match its sha256" in checkpoint.verify(tag)
    assert checkpoint.verify(tag, hashes=False) is None  # same size: only the hash sees it
    (tag / checkpoint.MODEL_STATES).write_bytes(b"short")
    assert "has 5 bytes, the record says 1024" in checkpoint.verify(tag)
    (tag / checkpoint.CONFIG_NAME).unlink()
    assert "config.yaml is missing" in checkpoint.verify(tag)


def test_resume_point_falls_back_past_damage_and_respects_a_rolled_back_pointer(tmp_path):
    cfg = cfg_in(tmp_path, "train.train_tokens=12288")  # 12 steps: step 6 is not the last
    make_tag(cfg, 3)
    six = make_tag(cfg, 6)
    assert restore.resume_point(cfg).tag == "step-0000006"
    (six / "zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    resume = restore.resume_point(cfg)
    assert resume.tag == "step-0000003" and not resume.finished
    assert "step-0000006: zero_pp_rank_0_mp_rank_00_optim_states.pt is missing" in resume.damaged[0]
    make_tag(cfg, 9)
    (cfg.checkpoint_dir / "latest").write_text("step-0000003")  # a user rolled back: newer tags are ignored
    assert restore.resume_point(cfg).tag == "step-0000003"


def test_a_folder_never_completed_is_a_fresh_start_and_a_tag_without_its_record_never_resumes(tmp_path):
    cfg = cfg_in(tmp_path)
    make_tag(cfg, 3, record=False)
    (cfg.checkpoint_dir / "latest").unlink()  # killed before its first `latest`
    assert restore.resume_point(cfg).tag is None
    (cfg.checkpoint_dir / "latest").write_text("step-0000003")  # a pointer at a tag whose save never completed
    with pytest.raises(ConfigError, match=r"step-0000003: integrity\.json is missing or unreadable"):
        restore.resume_point(cfg)


def test_finished_and_plan_changes(tmp_path):
    cfg = cfg_in(tmp_path)
    make_tag(cfg, 6)
    assert restore.resume_point(cfg).finished
    with pytest.raises(ConfigError, match=r"train\.warmup_fraction changed \(0\.025 -> 0\.1\).*allow_changes"):
        restore.resume_point(cfg_in(tmp_path, "train.warmup_fraction=0.1"))
    accepted = cfg_in(tmp_path, "train.warmup_fraction=0.1", "checkpoint.allow_changes=[train.warmup_fraction]")
    assert restore.resume_point(accepted).tag == "step-0000006"
    with pytest.raises(ConfigError, match="'model.d_model' cannot change on resume"):
        cfg_in(tmp_path, "checkpoint.allow_changes=[model.d_model]")


def test_every_reader_of_latest_goes_through_read_latest(tmp_path, monkeypatch):
    """`latest` has one reader: point it elsewhere and the trainer's resume and the readers all follow."""
    cfg = cfg_in(tmp_path, "train.train_tokens=12288")  # 12 steps: neither tag is the last
    make_tag(cfg, 3)
    make_tag(cfg, 6)  # the file says step-0000006
    monkeypatch.setattr(checkpoint, "read_latest", lambda checkpoint_dir: "step-0000003")
    assert checkpoint.latest_tag(cfg.checkpoint_dir) == "step-0000003"
    assert checkpoint.resolve_tag_dir(cfg.checkpoint_dir) == cfg.checkpoint_dir / "step-0000003"
    assert restore.resume_point(cfg).tag == "step-0000003"  # a rolled-back pointer is respected


@pytest.mark.parametrize(
    ("stage", "precision", "elastic"),
    [
        (0, "fp32", False),
        (1, "fp32", True),
        (1, "bf16", True),
        (2, "fp32", True),
        (2, "bf16", True),
        (3, "bf16", False),
    ],
)
def test_resume_policy_decides_a_data_parallel_change(tmp_path, stage, precision, elastic):
    """Whether a DP change may resume is the policy's answer alone, before any weights load."""
    cfg = cfg_in(tmp_path, f"parallel.zero_stage={stage}", f"train.precision={precision}")
    tag = make_tag(cfg, 3)
    restore.check_resume_policy(cfg, tag, saved_dp=2, dp=2)  # the same size: always
    restore.check_resume_policy(cfg, tag, saved_dp=2, dp=None)  # nothing trains here (finished)
    if elastic:
        restore.check_resume_policy(cfg, tag, saved_dp=2, dp=1)
    else:
        with pytest.raises(ConfigError, match=r"saved at data-parallel size 2, this run has 1; .* resume with 2"):
            restore.check_resume_policy(cfg, tag, saved_dp=2, dp=1)
    with pytest.raises(ConfigError, match=r"model\.d_model changed"):  # and the model, whatever the layout
        restore.check_resume_policy(cfg_in(tmp_path, "model.d_model=96"), tag, saved_dp=2, dp=2)

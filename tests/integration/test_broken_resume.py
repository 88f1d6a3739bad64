"""Broken resume state, plan changes and file-system errors, through the real `prism train` in a subprocess.

One uninterrupted 6-step run (checkpoints at steps 3 and 6) is copied for each case and damaged the way a
crash, a full disk or a careless user would; the rerun must fall back to the newest intact checkpoint and
say so in one line, or refuse in one line (exit 2, no traceback) saying what to delete or repoint.
"""

from __future__ import annotations

import json
import resource
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.integration.test_train import ROOT, checkpoint_dir, command, env, metrics, overrides

STEP3, STEP6 = "step-0000003", "step-0000006"


def prism_train(ov: list[str], preexec=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        command(ov, 1), cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300, preexec_fn=preexec
    )


def one_error_line(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 2, f"exit {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if line.startswith("prism train: error:")]
    assert len(lines) == 1, out.stderr[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def finished(tiny_data, tmp_path_factory):
    """An uninterrupted 6-step run: (output dir, its overrides, metrics)."""
    out = tmp_path_factory.mktemp("finished")
    ov = overrides(tiny_data, out)
    done = prism_train(ov)
    assert done.returncode == 0, done.stderr[-3000:]
    return out, ov, metrics(out)


@pytest.fixture
def copy_of(finished, tmp_path):
    """A fresh copy of the finished run and the overrides that point at it."""
    src, ov, _ = finished
    shutil.copytree(src, tmp_path / "run")
    return tmp_path / "run", [o for o in ov if not o.startswith("run.output_dir=")] + [
        f"run.output_dir={tmp_path / 'run'}"
    ]


def test_every_checkpoint_carries_an_integrity_record_written_last(finished):
    out, _, _ = finished
    for tag in (STEP3, STEP6):
        tag_dir = checkpoint_dir(out) / tag
        record = json.loads((tag_dir / "integrity.json").read_text())
        files = {p.name for p in tag_dir.iterdir()} - {"integrity.json"}
        assert set(record["files"]) == files and "config.yaml" in files
        assert all(record["files"][f]["size"] == (tag_dir / f).stat().st_size for f in files)
        assert (record["step"], record["dp_size"], record["tp"]) == (int(tag[5:]), 1, 1)
        assert (tag_dir / "integrity.json").stat().st_mtime_ns >= max((tag_dir / f).stat().st_mtime_ns for f in files)


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_a_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))


def _optim_file(tag_dir: Path) -> Path:
    return next(tag_dir.glob("*optim_states.pt"))


DAMAGE = {
    "truncated model states": (lambda d: _truncate(d / "mp_rank_00_model_states.pt"), "bytes, the record says"),
    "missing optimizer states": (lambda d: _optim_file(d).unlink(), "optim_states.pt is missing"),
    "missing config.yaml": (lambda d: (d / "config.yaml").unlink(), "config.yaml is missing"),
    "same-size corruption": (lambda d: _flip_a_byte(d / "mp_rank_00_model_states.pt"), "does not match its sha256"),
    "missing integrity record": (lambda d: (d / "integrity.json").unlink(), "integrity.json is missing"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_newest_checkpoint_falls_back_to_the_newest_intact_one(finished, copy_of, damage):
    _, _, ref = finished
    run, ov = copy_of
    ckpt = checkpoint_dir(run)
    harm, why = DAMAGE[damage]
    harm(ckpt / STEP6)
    out = prism_train(ov)
    assert out.returncode == 0, out.stderr[-3000:]
    warning = [line for line in out.stdout.splitlines() if line.startswith("prism train: warning:")]
    assert len(warning) == 1 and STEP6 in warning[0] and why in warning[0], out.stdout
    assert f"resuming from {STEP3}, the newest intact checkpoint" in warning[0]
    assert f"resumed from {STEP3}" in out.stdout
    got = metrics(run)
    assert [got[s]["train/loss"] for s in (4, 5, 6)] == [ref[s]["train/loss"] for s in (4, 5, 6)]  # exact
    # the damaged folder was replaced by a complete save
    assert (ckpt / "latest").read_text() == STEP6 and json.loads((ckpt / STEP6 / "integrity.json").read_text())


@pytest.mark.parametrize("pointer", ["", "..", "step-0000009", "../../etc"])
def test_broken_latest_pointer_falls_back(copy_of, pointer):
    run, ov = copy_of
    (checkpoint_dir(run) / "latest").write_text(pointer)
    out = prism_train(ov)
    assert out.returncode == 0, out.stderr[-3000:]
    warning = [line for line in out.stdout.splitlines() if line.startswith("prism train: warning:")]
    assert len(warning) == 1 and "latest" in warning[0] and f"resuming from {STEP6}" in warning[0], out.stdout
    assert "already finished" in out.stdout  # the newest intact checkpoint is the last step


def test_nothing_intact_is_one_line_that_says_what_to_delete_or_repoint(copy_of):
    run, ov = copy_of
    ckpt = checkpoint_dir(run)
    _truncate(ckpt / STEP6 / "mp_rank_00_model_states.pt")
    (ckpt / STEP3 / "config.yaml").unlink()
    line = one_error_line(prism_train(ov))
    assert "no intact checkpoint" in line and f"delete {ckpt}" in line and str(ckpt / "latest") in line
    assert STEP6 in line and STEP3 in line


def test_resuming_a_finished_run_is_a_no_op_that_says_so(copy_of):
    run, ov = copy_of
    before = (checkpoint_dir(run) / "metrics.jsonl").read_text()
    out = prism_train([*ov, "train.log_every=2"])  # a key that does not change the plan
    assert out.returncode == 0, out.stderr[-3000:]
    assert "already finished" in out.stdout and "nothing to do" in out.stdout
    assert (checkpoint_dir(run) / "metrics.jsonl").read_text() == before


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ("train.train_tokens=24576", "train.train_tokens"),  # 6 -> 24 steps: the LR schedule would jump back up
        ("train.lr=0.0005", "train.lr"),
        ("train.batch_tokens=2048", "train.batch_tokens"),
    ],
)
def test_a_resume_that_changes_the_plan_is_refused_naming_the_key(copy_of, change, key):
    run, ov = copy_of
    line = one_error_line(prism_train([*ov, change]))
    assert f"cannot resume, {key} changed" in line and "run.output_dir" in line


def test_an_accepted_plan_change_resumes(finished, copy_of):
    run, ov = copy_of
    out = prism_train([*ov, "train.train_tokens=8192", "checkpoint.allow_changes=[train.train_tokens]"])
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"resumed from {STEP6}" in out.stdout and max(metrics(run)) == 8


def test_disk_full_while_writing_a_checkpoint_is_one_line_and_keeps_the_last_good_one(finished, copy_of):
    """A real write failure: the child's RLIMIT_FSIZE is below a checkpoint file's size (Python ignores
    SIGXFSZ, so the kernel fails the write with EFBIG, as a full disk fails it with ENOSPC)."""
    _, _, ref = finished
    run, ov = copy_of
    ckpt = checkpoint_dir(run)
    shutil.rmtree(ckpt / STEP6)  # roll back to step 3: the next save is step 6
    (ckpt / "latest").write_text(STEP3)
    limit = (ckpt / STEP3 / "mp_rank_00_model_states.pt").stat().st_size // 2

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    line = one_error_line(prism_train(ov, preexec=small_files))
    assert f"while writing checkpoint {STEP6} in {ckpt}" in line and f"last good checkpoint {STEP3} is kept" in line
    assert "file too large" in line
    assert (ckpt / "latest").read_text() == STEP3 and not (ckpt / STEP6).exists()  # nothing half-written
    out = prism_train(ov)  # space back: it resumes from the kept one and finishes
    assert out.returncode == 0 and f"resumed from {STEP3}" in out.stdout, out.stderr[-3000:]
    assert metrics(run)[6]["train/loss"] == ref[6]["train/loss"]


@pytest.mark.parametrize("where", ["under a regular file", "not writable"])
def test_an_output_folder_that_cannot_be_written_is_one_line(tiny_data, tmp_path, where):
    if where == "under a regular file":
        (tmp_path / "a-file").write_text("x")
        output = tmp_path / "a-file" / "runs"
    else:
        output = Path("/proc/prism-runs")  # no process may create folders in procfs, root included
    line = one_error_line(prism_train(overrides(tiny_data, output)))
    assert "cannot create or write the checkpoint folder" in line and str(output) in line
    if where == "under a regular file":
        assert "a parent of it is a regular file" in line

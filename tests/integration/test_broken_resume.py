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
import time
from pathlib import Path

import pytest

from pipeline import checkpoint
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


def _rolled_back_to_step3(run: Path) -> Path:
    """The copy as a run killed after step 3's checkpoint: the next save is step 6."""
    ckpt = checkpoint_dir(run)
    shutil.rmtree(ckpt / STEP6)
    (ckpt / "latest").write_text(STEP3)
    return ckpt


def infra_fault_line(out: subprocess.CompletedProcess) -> str:
    """Exit 5 (the job script retries it) and one error line, no traceback."""
    assert out.returncode == 5, f"exit {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.startswith("prism train: error:")]
    assert len(lines) == 1, out.stdout[-3000:] + out.stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize("async_save", ["true", "false"])
def test_disk_full_at_the_last_save_is_an_infrastructure_fault_that_keeps_the_last_good_one(
    finished, copy_of, async_save
):
    """A real write failure: the child's RLIMIT_FSIZE is below a checkpoint file's size (Python ignores
    SIGXFSZ, so the kernel fails the write with EFBIG, as a full disk fails it with ENOSPC). The failed save
    is the run's last, so the run cannot end well: exit 5, and the retry from step 3 finishes it."""
    _, _, ref = finished
    run, ov = copy_of
    ckpt = _rolled_back_to_step3(run)
    limit = (ckpt / STEP3 / "mp_rank_00_model_states.pt").stat().st_size // 2

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    line = infra_fault_line(prism_train([*ov, f"checkpoint.async_save={async_save}"], preexec=small_files))
    assert f"checkpoint {STEP6} failed (file too large" in line and f"latest is {STEP3}" in line, line
    assert (ckpt / "latest").read_text() == STEP3 and not (ckpt / STEP6).exists()  # nothing half-written
    out = prism_train(ov)  # space back: it resumes from the kept one and finishes
    assert out.returncode == 0 and f"resumed from {STEP3}" in out.stdout, out.stderr[-3000:]
    assert metrics(run)[6]["train/loss"] == ref[6]["train/loss"]


def test_synchronous_and_background_saves_hold_the_same_state(finished, tmp_path):
    """The reference run saved in the background (the default); the same run saving synchronously has
    the same losses and, checkpoint for checkpoint, the same weights, fp32 masters and AdamW moments."""
    import torch

    src, ov, ref = finished
    ov = [o for o in ov if not o.startswith("run.output_dir=")] + [f"run.output_dir={tmp_path}"]
    out = prism_train([*ov, "checkpoint.async_save=false"])
    assert out.returncode == 0 and "in the background" not in out.stdout, out.stderr[-3000:]
    got = metrics(tmp_path)
    assert [got[s]["train/loss"] for s in range(1, 7)] == [ref[s]["train/loss"] for s in range(1, 7)]
    for tag in (STEP3, STEP6):
        a, b = checkpoint_dir(src) / tag, checkpoint_dir(tmp_path) / tag
        assert set(json.loads((a / "integrity.json").read_text())["files"]) == {p.name for p in b.iterdir()} - {
            "integrity.json"
        }
        for name in ("mp_rank_00_model_states.pt", _optim_file(a).name):
            x, y = (torch.load(d / name, map_location="cpu", weights_only=False) for d in (a, b))
            _assert_same_tensors(x, y, f"{tag}/{name}")
    # DeepSpeed's own reader of the ZeRO files rebuilds exactly the weights ours reads from a background save
    from pipeline import compat

    compat.import_deepspeed()
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    fp32 = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir(src)), tag=STEP6)
    weights, _ = checkpoint.read_weights(checkpoint_dir(src) / STEP6)
    assert fp32 and all(torch.equal(v, weights[k]) for k, v in fp32.items())


def _assert_same_tensors(x, y, where: str) -> None:
    import torch

    if isinstance(x, torch.Tensor):
        assert torch.equal(x, y), where
    elif isinstance(x, dict):
        assert x.keys() == y.keys(), where
        for k in x:
            _assert_same_tensors(x[k], y[k], f"{where}.{k}")
    elif isinstance(x, list | tuple):
        assert len(x) == len(y), where
        for i, (u, v) in enumerate(zip(x, y, strict=True)):
            _assert_same_tensors(u, v, f"{where}[{i}]")


def test_disk_full_during_a_background_write_warns_and_training_goes_on(finished, copy_of):
    _, _, ref = finished
    run, ov = copy_of
    ckpt = _rolled_back_to_step3(run)
    out = subprocess.run(
        command([*ov, "checkpoint.every_steps=1"], 1),
        cwd=ROOT,
        env={**env(), "PRISM_FAULT_CHECKPOINT_WRITE": "enospc:4"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    warning = [line for line in out.stdout.splitlines() if line.startswith("prism train: warning:")]
    assert len(warning) == 1 and "step-0000004 failed (no space left on device)" in warning[0], out.stdout
    assert "partial folder was removed" in warning[0] and "next save is attempted" in warning[0]
    assert not (ckpt / "step-0000004").exists() and (ckpt / "latest").read_text() == STEP6
    assert checkpoint.verify(ckpt / "step-0000005") is None and checkpoint.verify(ckpt / STEP6) is None
    assert [metrics(run)[s]["train/loss"] for s in (4, 5, 6)] == [ref[s]["train/loss"] for s in (4, 5, 6)]


def test_failed_saves_in_a_row_stop_the_run_as_an_infrastructure_fault(copy_of):
    run, ov = copy_of
    ckpt = _rolled_back_to_step3(run)
    out = subprocess.run(
        command([*ov, "checkpoint.every_steps=1", "checkpoint.max_failed_saves=2"], 1),
        cwd=ROOT,
        env={**env(), "PRISM_FAULT_CHECKPOINT_WRITE": "enospc:4,5"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = infra_fault_line(out)
    assert "step-0000005 failed (no space left on device)" in line and "2 failed saves in a row" in line, line
    assert (ckpt / "latest").read_text() == STEP3 and sorted(p.name for p in ckpt.glob("step-*")) == [STEP3]


def test_kill_during_a_background_write_resumes_from_the_previous_intact_checkpoint(finished, copy_of):
    """SIGKILL while step 6's files are being written (the writer stalls after its first file): `latest`
    still names step 3, the partial step 6 is passed over, and the rerun's losses are the reference's."""
    _, _, ref = finished
    run, ov = copy_of
    ckpt = _rolled_back_to_step3(run)
    first_file = ckpt / STEP6 / "mp_rank_00_model_states.pt"
    proc = subprocess.Popen(
        command(ov, 1),
        cwd=ROOT,
        env={**env(), "PRISM_FAULT_CHECKPOINT_WRITE": "stall:6"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 240
        while not first_file.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None and first_file.exists(), "the write did not start, or the run ended"
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert (ckpt / "latest").read_text() == STEP3 and not (ckpt / STEP6 / "integrity.json").exists()
    out = prism_train(ov)
    assert out.returncode == 0 and f"resumed from {STEP3}" in out.stdout, out.stderr[-3000:]
    assert [metrics(run)[s]["train/loss"] for s in (4, 5, 6)] == [ref[s]["train/loss"] for s in (4, 5, 6)]
    assert checkpoint.verify(ckpt / STEP6) is None and (ckpt / "latest").read_text() == STEP6


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

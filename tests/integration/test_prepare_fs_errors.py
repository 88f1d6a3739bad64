"""File-system errors during `prism prepare` are one line (exit 2, the path and the cause), leave nothing that
looks valid (no manifest.json, no shard under its real name from the failed task), and a rerun resumes.

A real write failure without root: the child's RLIMIT_FSIZE is below a shard's size. Python ignores SIGXFSZ,
so the kernel fails the write with EFBIG (as a full disk fails it with ENOSPC), inside a datatrove worker
process whose exception the pool re-raises in the parent.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.dataset import MANIFEST, SHARD_GLOB

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny_prism.yaml"


def prism_prepare(args: list[str], preexec=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "prepare", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=preexec,
    )


def one_error_line(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 2, f"exit {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("prism prepare: error:"), out.stderr[-3000:]
    return lines[0]


def build_args(tiny_data, tmp_path: Path, dataset_dir: Path) -> list[str]:
    # A few documents per task: enough for whole shards in both splits, seconds to build.
    return [
        str(TINY),
        *tiny_data.overrides,
        "data.limit=150",
        "data.val_sets={}",  # else prepare rebuilds the fixture's held-out set with this limit, and is refused
        f"data.dataset_dir={dataset_dir}",
        f"run.output_dir={tmp_path / 'runs'}",
    ]


def test_a_write_failure_while_writing_shards_is_one_line_and_a_rerun_completes(tiny_data, tmp_path):
    dataset = tmp_path / "dataset"
    shard = tiny_data.dataset_dir / tiny_data.manifest["splits"]["train"]["shards"][0]["path"]
    limit = shard.stat().st_size // 2

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    line = one_error_line(prism_prepare(build_args(tiny_data, tmp_path, dataset), preexec=small_files))
    assert f"while writing shards in {dataset};" in line, line
    assert f"file too large (the process file-size limit, ulimit -f, is {limit} bytes)" in line, line
    assert "nothing of this build is marked complete (no manifest)" in line, line
    # Nothing half-written looks valid: no manifest, no shard under a real shard name.
    assert not (dataset / MANIFEST).exists()
    assert not [p for split in ("train", "val") for p in (dataset / split).glob(SHARD_GLOB)]

    done = prism_prepare(build_args(tiny_data, tmp_path, dataset))  # the limit lifted: it resumes and finishes
    assert done.returncode == 0 and (dataset / MANIFEST).is_file(), done.stderr[-3000:]
    verified = prism_prepare(["--verify", str(dataset)])
    assert verified.returncode == 0 and "every shard matches" in verified.stdout, verified.stderr[-3000:]


@pytest.mark.parametrize("where", ["under a regular file", "a regular file", "not writable"])
def test_a_dataset_folder_that_cannot_be_written_is_one_line(tiny_data, tmp_path, where):
    (tmp_path / "a-file").write_text("x")
    dataset = {
        "under a regular file": tmp_path / "a-file" / "dataset",
        "a regular file": tmp_path / "a-file",
        "not writable": Path("/proc/prism-dataset"),  # no process may create folders in procfs, root included
    }[where]
    line = one_error_line(prism_prepare(build_args(tiny_data, tmp_path, dataset)))
    assert f"{dataset}: cannot create or write this folder" in line and "data.dataset_dir" in line, line
    if where == "under a regular file":
        assert "a parent of it is a regular file" in line
    if where == "a regular file":
        assert "it is a regular file, not a folder" in line and (tmp_path / "a-file").read_text() == "x"

"""Every ```sh block of README.md and docs/*.md runs as written on this CPU machine and prints what the docs
show after it (the convention: docs/README.md, "Writing these docs"; the blocks: tests/docs_blocks.py).

How a block runs: `bash -e -o pipefail` in a scratch folder that mirrors the repository root (a symlink per
top-level entry, copies of configs/ and launchers/, so `configs/...` resolves and whatever a command writes, `runs/` included, lands in the
scratch folder), this venv's bin first on PATH, and the documented placeholders set to the session fixtures:

    $OUT           an empty folder of the block's own
    $DATA_DIR      tiny_data's prepared dataset
    $RUN_DIR       tiny_checkpoints' Prism run folder (a 2-step run with checkpoints and an MLflow run)
    $TRACKING_URI  tracked_runs' MLflow server, $EXPERIMENT its experiment (both arms, two seeds)

A ```text block right after the ```sh block is its output: each line (but `...`) must be found in a line it
printed. Nothing here trains: the fixtures are shared with the rest of the suite. ```sh cluster and ```sh long
blocks (a cluster, a GPU, or minutes: `make demo` is tests/integration/test_demo.py's) are checked to parse
in tests/unit/test_docs.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs_blocks import doc_blocks

ROOT = Path(__file__).resolve().parents[2]
COPIED = ("configs", "launchers")
BLOCKS = [pytest.param(b, id=b.where()) for b in doc_blocks() if b.info == "sh"]


@pytest.fixture(scope="module")
def placeholders(tiny_data, tiny_checkpoints, tracked_runs) -> dict[str, str]:
    return {
        "DATA_DIR": str(tiny_data.dataset_dir),
        "RUN_DIR": str(tiny_checkpoints.prism.parent),
        "TRACKING_URI": tracked_runs.uri,
        "EXPERIMENT": tracked_runs.experiment,
    }


def mirror_of_the_repository(where: Path) -> Path:
    """Symlinks to the repository's entries; copies of the small folders a command resolves paths in (a spec's
    `config:` under a symlink would resolve outside the folder and print as an absolute path)."""
    where.mkdir()
    for entry in ROOT.iterdir():
        if entry.name in COPIED:
            shutil.copytree(entry, where / entry.name)
        elif entry.name not in (".git", "runs"):
            (where / entry.name).symlink_to(entry)
    return where


def expected_lines(output: str, env: dict[str, str]) -> list[str]:
    lines = [line.strip() for line in output.splitlines()]
    for name in ("OUT", "DATA_DIR", "RUN_DIR", "TRACKING_URI", "EXPERIMENT"):
        lines = [line.replace(f"${name}", env[name]) for line in lines]
    return [line for line in lines if line and line != "..."]


@pytest.mark.parametrize("block", BLOCKS)
def test_documented_block_runs(block, placeholders, tmp_path):
    env = {
        **os.environ,
        **placeholders,
        "OUT": str(tmp_path / "out"),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
    }
    Path(env["OUT"]).mkdir()
    cwd = mirror_of_the_repository(tmp_path / "repo")
    result = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", block.body],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    printed = result.stdout + result.stderr
    assert result.returncode == 0, f"{block.where()} exited {result.returncode}:\n{block.body}\n{printed[-3000:]}"
    got = [line.strip() for line in printed.splitlines()]
    missing = [want for want in expected_lines(block.output or "", env) if not any(want in line for line in got)]
    assert not missing, f"{block.where()}: not printed: {missing}\n--- printed:\n{printed[-3000:]}"

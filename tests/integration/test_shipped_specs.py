"""The runs a policy moves keep the preset's data: `prism search launchers/searches/tiny.yaml` (the shipped spec,
its rungs and trials cut down) and a sweep over schedules of the tiny preset, each started in a folder laid out
as a fresh clone's `prism prepare` leaves it (runs/data/, where the preset's `{output_dir}` paths point), so a
trial or a schedule that looked for its data in its own folder would fail at step 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
# the session's tiny data, smaller than the preset's: the same keys for both specs
SMALL = {
    "model.seq_len": 128,
    "train.batch_tokens": 1024,
    "train.micro_batch_size": 8,
    "train.val_tokens": 1024,
    "data.val_sets.heldout.tokens": 1024,
    "tracking.system_metrics": False,
}


@pytest.fixture
def clone_layout(tiny_data, tmp_path) -> tuple[Path, dict]:
    """A working folder whose runs/data/ holds the two prepared datasets where the tiny preset's
    `{output_dir}/data/...` paths name them, and the overrides naming the session's corpora and tokenizer as
    they were spelled when those datasets were built (a dataset's identity holds its input and tokenizer)."""
    data = tmp_path / "runs" / "data"
    data.mkdir(parents=True)
    (data / "embedded-bpe8k-256").symlink_to(tiny_data.dataset_dir)
    (data / "embedded-heldout-bpe8k-256").symlink_to(tiny_data.heldout_dir)
    built_from = {
        "data.input": str(tiny_data.corpus_dir),
        "data.tokenizer": str(tiny_data.tokenizer),
        "data.val_sets.heldout.input": str(tiny_data.heldout_corpus),
    }
    return tmp_path, {**SMALL, **built_from}


def test_the_shipped_tiny_search_completes_its_trials(clone_layout):
    folder, overrides = clone_layout
    spec = yaml.safe_load((ROOT / "launchers/searches/tiny.yaml").read_text())
    spec["overrides"] |= overrides
    spec |= {"trials": 2, "rungs": {"min_tokens": 2048, "reduction_factor": 2, "full_tokens": 4096}}
    spec.pop("confirm")
    path = folder / "tiny.yaml"
    path.write_text(yaml.safe_dump(spec))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "search", str(path), "--poll-s", "0.5"],
        cwd=folder,  # trials start in the checkout: the relative data paths must not follow them there
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    state = json.loads((folder / "runs/searches/tiny/search.json").read_text())
    trials = [r for r in state["runs"].values() if r["kind"] == "trial"]
    assert len(trials) == 2 and {r["status"] for r in trials} <= {"complete", "pruned"}, trials
    assert any(r["status"] == "complete" and r["tokens"] == 4096 for r in trials), trials


def test_a_sweep_over_schedules_of_the_tiny_preset_trains(clone_layout, monkeypatch):
    from pipeline import sweep

    folder, overrides = clone_layout
    monkeypatch.chdir(folder)
    schedules = ["3x2,6x2,12x4"]  # one: each job is a torchrun, ~40 s on two cores (unit tests check the folders)
    s = sweep.submit(
        arms=["prism"],
        scales=["tiny"],
        seeds=[1],
        schedules=schedules,
        overrides={**overrides, "train.train_tokens": 2048, "checkpoint.every_steps": 100},
        executor="local",
        folder=folder / "sweep",
        name="schedules",
        timeout_min=10,
    )
    results = s.wait(timeout_s=240)
    assert [r["exit_code"] for r in results] == [0]
    # the run in the schedule's folder, trained to the end on the data the preset names
    run_dir = folder / "runs" / "sched-3x2_6x2_12x4" / "prism-tiny-s1"
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-0000002", run_dir

"""One writer per run, with real trainers: while one `prism train` trains a folder, a second one (alone, and as
two torchrun ranks) refuses in one line naming the first, exits 2 on every rank and changes nothing: the first
run's checkpoints hold the weights a lone run trained (the tiny_checkpoints fixture, same overrides), its
lock file still names it, and its MLflow store holds one run. About 40 s: the first trainer's rank 0 sleeps
6 s in each of its two steps (PRISM_FAULT_SLOW_RANK, the math unchanged) so the others meet it training."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch

from pipeline import checkpoint, config, run_lock
from tests.integration.test_launchers import ROOT


def test_a_second_trainer_on_a_training_folder_refuses_and_changes_nothing(tiny_checkpoints, tmp_path):
    overrides = [*tiny_checkpoints.overrides, f"run.output_dir={tmp_path}"]
    cfg = config.load(ROOT / "configs/tiny_prism.yaml", overrides)
    train = ["-m", "pipeline.cli", "train", "configs/tiny_prism.yaml", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    pipe = dict(cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = subprocess.Popen([sys.executable, *train], env={**env, "PRISM_FAULT_SLOW_RANK": "0:6"}, **pipe)
    lock = cfg.checkpoint_dir / run_lock.LOCK_FILE
    deadline = time.monotonic() + 120
    while not (lock.exists() and lock.read_text()):
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()
        time.sleep(0.1)
    holder = lock.read_text()
    alone = subprocess.Popen([sys.executable, *train], env=env, **pipe)
    ranks = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-port=29731", *train],
        env=env,
        **pipe,
    )
    out, err = alone.communicate(timeout=120)
    assert alone.returncode == 2, out + err
    [line] = err.splitlines()
    assert f"pid {first.pid} on host" in line and "holds this run folder" in line, line
    ranks_out, ranks_err = ranks.communicate(timeout=120)
    assert ranks.returncode != 0 and ranks_err.count(f"holds this run folder (pid {first.pid}") == 2, ranks_err
    assert first.poll() is None, "the refusals came after the first trainer ended: nothing was tested"
    assert lock.read_text() == holder

    log, err = first.communicate(timeout=300)
    assert first.returncode == 0, log + err
    assert not lock.exists()  # released at the end
    tags = checkpoint.tag_names(cfg.checkpoint_dir)
    assert tags == checkpoint.tag_names(tiny_checkpoints.prism) and tags, tags
    for tag in tags:
        mine, _ = checkpoint.read_weights(cfg.checkpoint_dir / tag)
        lone, _ = checkpoint.read_weights(tiny_checkpoints.prism / tag)
        assert mine.keys() == lone.keys(), tag
        for name, value in lone.items():  # tensors, and None for megatron's empty extra states
            assert torch.equal(mine[name], value) if torch.is_tensor(value) else mine[name] == value, (tag, name)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name(cfg.experiment).experiment_id])
    assert [r.info.run_name for r in runs] == [cfg.run_name], json.dumps([r.info.run_name for r in runs])


def test_the_lock_of_a_killed_trainer_is_taken_over_and_the_run_completes(tiny_checkpoints, tmp_path):
    """kill -9 (what a killed job or a lost node does to the trainer) leaves the lock file naming it; the next
    start says it takes the lock over, from whom and why, and trains the run to its end. About 25 s."""
    overrides = [*tiny_checkpoints.overrides, f"run.output_dir={tmp_path}", "tracking.enabled=false"]
    cfg = config.load(ROOT / "configs/tiny_prism.yaml", overrides)
    train = [sys.executable, "-m", "pipeline.cli", "train", "configs/tiny_prism.yaml", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    killed = subprocess.Popen(train, cwd=ROOT, env={**env, "PRISM_FAULT_SLOW_RANK": "0:30"}, stdout=subprocess.DEVNULL)
    lock = cfg.checkpoint_dir / run_lock.LOCK_FILE
    deadline = time.monotonic() + 120
    while not (lock.exists() and lock.read_text()):
        assert killed.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    killed.kill()
    killed.wait()
    assert json.loads(lock.read_text())["pid"] == killed.pid  # left behind

    out = subprocess.run(train, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    [line] = [x for x in out.stdout.splitlines() if "took over" in x]
    assert f"from pid {killed.pid} on host" in line and f"pid {killed.pid} no longer runs" in line, line
    assert checkpoint.read_latest(cfg.checkpoint_dir) == checkpoint.tag_for(2) and not lock.exists()


def test_a_bad_max_batch_requeue_is_one_line_and_exit_2_before_anything_is_written(tmp_path):
    env = {**os.environ, "PRISM_MAX_BATCH_REQUEUE": "five"}
    cmd = [sys.executable, "-m", "pipeline.cli", "train", "configs/tiny_prism.yaml", f"run.output_dir={tmp_path}"]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "PRISM_MAX_BATCH_REQUEUE='five'" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert [p.name for p in tmp_path.iterdir() if p.name != "logs"] == []

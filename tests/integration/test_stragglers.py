"""Naming the slow rank (pipeline.stragglers) over 2 real gloo processes, one made slower through
PRISM_FAULT_SLOW_RANK; and every node's system metrics carry the node's name (pipeline.tracking.system)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pipeline.stragglers import straggler_metrics, straggler_note
from pipeline.tracking.system import NodeMetrics, metric_node_id

ROOT = Path(__file__).resolve().parents[2]

WORKER = """
import json, os, sys, time
import torch, torch.distributed as dist
from pipeline import faults
from pipeline.stragglers import RankClock, gather_rank_times, straggler_metrics, straggler_note
rank = int(sys.argv[2])
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=rank, world_size=2)
clock = RankClock("cpu", faults.slow_rank_seconds(rank))
torch.randn(64, 64) @ torch.randn(64, 64)  # first-call costs out of the clock
dist.barrier()  # both start together
start = time.perf_counter()
for _ in range(3):
    with clock.data():
        batch = torch.randn(64, 64)
    with clock.forward():
        out = batch @ batch
    dist.all_reduce(out)  # the step's collective: the fast rank waits here for the slow one
    clock.step_done()
wall = (time.perf_counter() - start) / 3
metrics = straggler_metrics(gather_rank_times(clock, "cpu"))
print(json.dumps({"metrics": metrics, "note": straggler_note(metrics), "wall": wall}), flush=True)
dist.destroy_process_group()  # else gloo's threads outlive the interpreter: "terminate called", exit != 0
"""


def test_the_slow_rank_is_named_though_wall_step_times_are_equal(tmp_path):
    env = {**os.environ, "PRISM_FAULT_SLOW_RANK": "1:0.3", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    store = tmp_path / "store"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(store), str(r)], env=env, stdout=subprocess.PIPE, text=True, cwd=ROOT
        )
        for r in range(2)
    ]
    outs = [json.loads(p.communicate(timeout=120)[0].strip().splitlines()[-1]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs[0]["metrics"] == outs[1]["metrics"]  # gathered: every rank has every rank's time
    m = outs[0]["metrics"]
    assert m["perf/slowest_rank"] == 1 and m["perf/rank_time_max"] >= 0.3
    assert outs[0]["note"].startswith(" | slowest rank 1 +")
    # the wall time per step is the same on both ranks (the collective waits): it could not have named rank 1
    assert min(o["wall"] for o in outs) >= 0.3 and abs(outs[0]["wall"] - outs[1]["wall"]) < 0.1


def test_no_rank_is_named_when_none_is_notably_slower():
    m = straggler_metrics([0.10, 0.11, 0.12, 0.10])
    assert m["perf/slowest_rank"] == 2 and straggler_note(m) == ""
    assert straggler_note(straggler_metrics([0.1, 0.1, 0.2])) == " | slowest rank 2 +100%"


def test_system_metrics_carry_the_node_name(tmp_path, monkeypatch):
    import mlflow

    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.2")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("nodes")).info.run_id
    assert metric_node_id("gpu-a12.cluster:0/x") == "gpu-a12.cluster_0_x"
    metrics = NodeMetrics(run_id, uri, "gpu-a12.cluster:0/x").start()
    deadline = time.time() + 30
    keys: set[str] = set()
    while time.time() < deadline and "system/gpu-a12.cluster_0_x/cpu_utilization_percentage" not in keys:
        time.sleep(0.2)
        keys = set(client.get_run(run_id).data.metrics)
    metrics.finish()
    assert "system/gpu-a12.cluster_0_x/cpu_utilization_percentage" in keys, keys
    assert all(k.startswith("system/gpu-a12.cluster_0_x/") for k in keys)


@pytest.mark.timeout(30)
def test_an_unreachable_server_never_blocks_the_caller():
    start = time.perf_counter()
    metrics = NodeMetrics("0" * 32, "http://127.0.0.1:9", "node1", retry_after_s=0.1).start()
    metrics.finish()
    assert time.perf_counter() - start < 1.0


@pytest.mark.timeout(60)
def test_a_monitor_built_after_finish_is_never_started(monkeypatch):
    # finish() lands while the monitor is being built (its constructor asks the server for the run): the
    # monitor must not start afterwards, or its thread outlives the run and logs into whatever runs next
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    metrics = NodeMetrics("0" * 32, "http://127.0.0.1:9", "node1", retry_after_s=0.1)
    built = threading.Event()
    from mlflow.system_metrics import system_metrics_monitor as smm

    original = smm.SystemMetricsMonitor.__init__

    def build_then_finish(self, *args, **kwargs):
        original(self, *args, **kwargs)
        built.set()
        metrics.finish(wait_s=0)  # the stop arrives between construction and start

    monkeypatch.setattr(smm.SystemMetricsMonitor, "__init__", build_then_finish)
    metrics.start()
    assert built.wait(50)
    metrics._thread.join(10)
    assert not metrics._thread.is_alive()
    assert metrics.monitor is None

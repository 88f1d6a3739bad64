"""`ops/mlflow_server.sh` on a port another server already holds (issue 14 item 11): with the session's real
`mlflow server` on the port, a second start fails with one line and the first keeps serving its own store."""

from __future__ import annotations

import subprocess
import time

from mlflow.tracking import MlflowClient

from tests.fixtures.mlflow_server import MlflowServer


def test_a_second_server_on_a_taken_port_fails_with_one_line_and_the_first_keeps_serving(mlflow_server, tmp_path):
    before = MlflowClient(mlflow_server.url).create_experiment(f"first-{time.time()}")
    second = MlflowServer(tmp_path / "second", mlflow_server.port)
    out = second._run("start")
    assert out.returncode == 2, out.stdout + out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert f"port {mlflow_server.port}" in line and "already in use" in line
    assert not (second.folder / "server.pid").exists()
    assert second._run("status").returncode == 1
    time.sleep(12)  # today's bug: the second server died ~10 s later while `start` had said "running"
    assert mlflow_server.running()
    assert MlflowClient(mlflow_server.url).get_experiment(before) is not None  # runs still reach the first store


def test_status_and_start_refuse_a_pid_file_whose_process_does_not_hold_the_port(mlflow_server, tmp_path):
    # A pid file naming a live process that is not the server answering on the port (e.g. a reused pid).
    other = subprocess.Popen(["setsid", "sleep", "120"])
    try:
        second = MlflowServer(tmp_path / "second", mlflow_server.port)
        second.folder.mkdir()
        (second.folder / "server.pid").write_text(f"{other.pid}\n")
        assert second._run("status").returncode == 1
        out = second._run("start")
        assert out.returncode == 2 and "does not hold port" in out.stderr, out.stdout + out.stderr
    finally:
        other.kill()
        other.wait()

"""Credentials in a tracking URI are used to connect and written nowhere in clear (issue 14 item 10): a real
tracker process against the session's real `mlflow server`, and one against a dead port."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from mlflow.tracking import MlflowClient

from pipeline import config
from pipeline.redaction import redact_uri

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "s3cr3t-Pa55"

RUN = """
import sys
from pipeline import config
from pipeline.tracking.mlflow_run import MlflowTracker
cfg = config.load("configs/tiny_prism.yaml", [f"run.output_dir={sys.argv[1]}", f"tracking.uri={sys.argv[2]}",
                  "tracking.system_metrics=false", "tracking.experiment=secrets"])
tracker = MlflowTracker(cfg)
print("RUN", tracker.start(cfg))
tracker.log_metrics({"train/loss": 5.0}, 1)
tracker.finish()
"""


def run_tracker(out: Path, uri: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}
    return subprocess.run(
        [sys.executable, "-c", RUN, str(out), uri], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


def files_text(folder: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in folder.rglob("*") if p.is_file() and p.suffix != ".db")


def test_credentials_connect_but_are_never_written_or_printed(mlflow_server, tmp_path):
    uri = mlflow_server.url.replace("http://", f"http://alice:{PASSWORD}@")
    out = run_tracker(tmp_path, uri)
    assert out.returncode == 0, out.stderr[-3000:]
    run_id = out.stdout.split("RUN ")[1].split()[0]  # the run exists: the real URI connected
    assert PASSWORD not in out.stdout + out.stderr
    assert PASSWORD not in files_text(tmp_path)  # journal, tracking-state.json, artifact copies
    run = MlflowClient(mlflow_server.url).get_run(run_id)
    assert run.data.params["tracking.uri"] == mlflow_server.url.replace("http://", "http://alice:***@")
    assert PASSWORD not in str(run.data.params) + str(run.data.tags)

    dead = run_tracker(tmp_path / "offline", f"http://alice:{PASSWORD}@127.0.0.1:9")  # the warning lines
    assert dead.returncode == 0 and "unavailable" in dead.stderr
    assert PASSWORD not in dead.stdout + dead.stderr + files_text(tmp_path / "offline")


def test_checkpoint_config_yaml_masks_the_password_and_keeps_the_rest(tmp_path):
    cfg = config.load("configs/tiny_prism.yaml", [f"tracking.uri=https://bob:{PASSWORD}@mlflow.example:443/x"])
    assert "https://bob:***@mlflow.example:443/x" in cfg.dump() and PASSWORD not in cfg.dump()
    assert cfg.tracking.uri == f"https://bob:{PASSWORD}@mlflow.example:443/x"  # the live value is untouched
    assert redact_uri("http://127.0.0.1:5000") == "http://127.0.0.1:5000"
    assert redact_uri("sqlite:////a:b@c/mlflow.db") == "sqlite:////a:b@c/mlflow.db"

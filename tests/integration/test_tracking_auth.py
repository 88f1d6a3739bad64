"""An authenticated MLflow server (issue 41 item 4): `ops/mlflow_server.sh start --auth` on loopback, a user
created and granted EDIT with `prism tracking grant` trains a real tiny run through ~/.mlflow/credentials,
an anonymous request gets 401 and a user without a grant 403, no password lands in any file or log, the
offline journal syncs to it, and a start without a private password file fails in one line."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from pipeline.cli import main
from pipeline.tracking.journal import Journal
from pipeline.tracking.mlflow_run import MlflowTracker
from tests.fixtures.mlflow_server import MlflowServer, free_port
from tests.unit.test_tracking import fake_val_losses, log_steps, tiny_cfg

ROOT = Path(__file__).resolve().parents[2]
ADMIN_PASSWORD = "adm1n-Pa55word-41"
BOB_PASSWORD = "b0b-Pa55word-41"
CAROL_PASSWORD = "car0l-Pa55word-41"
EXPERIMENT = "auth-tiny"


def private_file(path: Path, text: str, mode: int = 0o600) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)
    return path


def auth_server_at(folder: Path) -> MlflowServer:
    server = MlflowServer(folder, free_port())
    server.env["MLFLOW_ADMIN_PASSWORD_FILE"] = str(private_file(folder / "admin-password", ADMIN_PASSWORD))
    server.env["MLFLOW_SECRET_KEY_FILE"] = str(private_file(folder / "secret-key", "f1a5k-secret-for-tests"))
    return server


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory):
    server = auth_server_at(tmp_path_factory.mktemp("mlflow-auth"))
    server.start("--auth")
    yield server
    server.stop()


def as_user(monkeypatch, user: str | None, password: str | None) -> None:
    for key, value in (("MLFLOW_TRACKING_USERNAME", user), ("MLFLOW_TRACKING_PASSWORD", password)):
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, value)


def grant(monkeypatch, server, user, password_file, experiment, *more) -> int:
    as_user(monkeypatch, "admin", ADMIN_PASSWORD)
    argv = ["tracking", "grant", user, "--experiment", experiment, "--tracking-uri", server.url]
    return main([*argv, "--password-file", str(password_file), *more])


def http_status(url: str, user: str | None = None, password: str | None = None) -> int:
    request = urllib.request.Request(url)
    if user is not None:
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    try:
        return urllib.request.urlopen(request, timeout=10).status
    except urllib.error.HTTPError as e:
        return e.code


def texts_holding(folder: Path, secrets: list[str]) -> list[str]:
    """Every file under ``folder`` (binary ones too: SQLite stores) whose bytes hold one of ``secrets``."""
    return [str(p) for p in folder.rglob("*") if p.is_file() and any(s.encode() in p.read_bytes() for s in secrets)]


def command_lines() -> list[bytes]:
    lines = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            lines.append(Path(f"/proc/{pid}/cmdline").read_bytes())
        except OSError:  # the process ended meanwhile
            continue
    return lines


def test_start_without_a_private_password_file_fails_in_one_line(tmp_path):
    server = auth_server_at(tmp_path / "srv")
    Path(server.env["MLFLOW_ADMIN_PASSWORD_FILE"]).unlink()
    cases = [("missing password", "does not exist")]
    out = [server._run("start", "--auth")]
    private_file(Path(server.env["MLFLOW_ADMIN_PASSWORD_FILE"]), ADMIN_PASSWORD, 0o644)
    cases.append(("open password", "mode 644"))
    out.append(server._run("start", "--auth"))
    Path(server.env["MLFLOW_ADMIN_PASSWORD_FILE"]).chmod(0o600)
    Path(server.env["MLFLOW_SECRET_KEY_FILE"]).chmod(0o640)
    cases.append(("open secret key", "mode 640"))
    out.append(server._run("start", "--auth"))
    cases.append(("unknown option", "unknown option '--tls'"))
    out.append(server._run("start", "--tls"))
    Path(server.env["MLFLOW_SECRET_KEY_FILE"]).chmod(0o600)
    server.env["MLFLOW_ADMIN_USER"] = "admin\ndefault_permission = MANAGE"  # would rewrite the auth config
    cases.append(("admin name", "is not a user name"))
    out.append(server._run("start", "--auth"))
    for (name, cause), result in zip(cases, out):
        assert result.returncode == 2, f"{name}: {result.stdout}{result.stderr}"
        (line,) = result.stderr.strip().splitlines()
        assert cause in line, f"{name}: {line}"
        assert ADMIN_PASSWORD not in result.stdout + result.stderr
    assert not (server.folder / "server.pid").exists() and not (server.folder / "mlflow.db").exists()


def test_grant_rejects_bad_values_in_one_line(tmp_path, capsys, auth_server):
    open_file = private_file(tmp_path / "open", BOB_PASSWORD, 0o644)
    base = ["tracking", "grant", "bob", "--experiment", EXPERIMENT]
    cases = {
        "sqlite:///x.db": ([*base, "--tracking-uri", "sqlite:///x.db"], "only on a server"),
        "password in uri": ([*base, "--tracking-uri", "http://admin:pw@127.0.0.1:1"], "holds a password"),
        "permission": ([*base, "--tracking-uri", auth_server.url, "--permission", "ALL"], "not one of"),
        "open file": ([*base, "--tracking-uri", auth_server.url, "--password-file", str(open_file)], "mode 644"),
        "no file": ([*base, "--tracking-uri", auth_server.url, "--password-file", str(tmp_path / "x")], "not exist"),
    }
    for name, (argv, cause) in cases.items():
        assert main(argv) == 2, name
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert cause in line and "pw@" not in line, f"{name}: {line}"


def test_a_granted_user_trains_others_are_refused_and_no_password_is_written(
    auth_server, tiny_data, tmp_path, monkeypatch
):
    bob_file = private_file(tmp_path / "secrets" / "bob", BOB_PASSWORD)
    assert grant(monkeypatch, auth_server, "bob", bob_file, EXPERIMENT) == 0
    carol_file = private_file(tmp_path / "secrets" / "carol", CAROL_PASSWORD)
    assert grant(monkeypatch, auth_server, "carol", carol_file, "carol-only") == 0
    # The job's credentials: ~/.mlflow/credentials of the (job's) home, nothing in its environment.
    home = tmp_path / "home"
    private_file(
        home / ".mlflow" / "credentials",
        f"[mlflow]\nmlflow_tracking_username = bob\nmlflow_tracking_password = {BOB_PASSWORD}\n",
    )
    out = tmp_path / "runs"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_TRACKING_")}
    env.update({"HOME": str(home), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    cmd = [sys.executable, "-m", "pipeline.cli", "train", "configs/tiny_prism.yaml", *tiny_data.overrides]
    cmd += ["train.batch_tokens=1024", "train.micro_batch_size=8", "train.train_tokens=3072", "train.val_every=2"]
    cmd += ["train.val_tokens=1024", f"run.output_dir={out}", f"tracking.uri={auth_server.url}"]
    cmd += [f"tracking.experiment={EXPERIMENT}", "tracking.system_metrics=false"]
    job = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    job_log = tmp_path / "job.log"
    job_log.write_text(job.stdout + job.stderr)
    assert job.returncode == 0, job_log.read_text()[-3000:]
    assert "unavailable" not in job_log.read_text()  # it logged online, not to the journal only

    as_user(monkeypatch, "bob", BOB_PASSWORD)
    client = MlflowClient(auth_server.url)
    exp = client.get_experiment_by_name(EXPERIMENT)
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.status == "FINISHED" and run.data.tags["arm"] == "prism"
    assert run.data.params["tracking.uri"] == auth_server.url and run.data.params["run.arm"] == "prism"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [1, 2, 3]
    # MLflow #13832 (non-admins could not log artifacts to a local store) does not bite: the server proxies them
    assert {"config.yaml", "schedule.md"} <= {a.path for a in client.list_artifacts(run.info.run_id)}
    assert Journal(out / run.info.run_name / "checkpoints").pending() == []

    get_exp = f"{auth_server.url}/api/2.0/mlflow/experiments/get?experiment_id={exp.experiment_id}"
    assert http_status(get_exp) == 401
    assert http_status(get_exp, "carol", CAROL_PASSWORD) == 403
    assert http_status(get_exp, "bob", BOB_PASSWORD) == 200
    secrets = [ADMIN_PASSWORD, BOB_PASSWORD, CAROL_PASSWORD]
    assert not any(ADMIN_PASSWORD.encode() in cmd for cmd in command_lines())  # what `ps` shows
    assert texts_holding(out, secrets) == []  # run folder: checkpoints, journal, state, logs
    assert job_log.is_file() and sorted(texts_holding(tmp_path, secrets)) == sorted(
        [str(bob_file), str(carol_file), str(home / ".mlflow" / "credentials")]
    )  # the job log and run folder hold none; only the secret files we wrote do
    # The server's folder: store, artifacts, auth database (hashes only), config, log; the password file aside.
    held = texts_holding(auth_server.folder, secrets)
    assert held == [auth_server.env["MLFLOW_ADMIN_PASSWORD_FILE"]], held


def test_journal_buffered_offline_syncs_to_the_authenticated_server(auth_server, tmp_path, monkeypatch, caplog):
    dead = f"http://127.0.0.1:{free_port()}"
    cfg = tiny_cfg(tmp_path, "uniform", [f"tracking.uri={dead}", f"tracking.experiment={EXPERIMENT}"])
    steps, losses = [1, 2, 3], fake_val_losses(3)
    tracker = MlflowTracker(cfg)
    monkeypatch.setenv("SLURM_JOB_ID", "41")  # a job that got the password through its environment is told so
    as_user(monkeypatch, "bob", BOB_PASSWORD)
    with caplog.at_level("WARNING", logger="prism.tracking"):
        assert tracker.start(cfg) is None
    assert "MLFLOW_TRACKING_PASSWORD is in this Slurm job's environment" in caplog.text
    assert BOB_PASSWORD not in caplog.text
    monkeypatch.delenv("SLURM_JOB_ID")
    log_steps(tracker, steps, losses, cfg.train.batch_tokens)
    tracker.finish()
    pending = len(Journal(cfg.checkpoint_dir).pending())
    sync = ["tracking", "sync", str(cfg.run_dir), "--tracking-uri", auth_server.url]
    as_user(monkeypatch, None, None)
    assert main(sync) == 2 and len(Journal(cfg.checkpoint_dir).pending()) == pending  # anonymous: refused, kept
    bob_file = private_file(tmp_path / "bob", BOB_PASSWORD)
    assert grant(monkeypatch, auth_server, "bob", bob_file, EXPERIMENT) == 0  # the granted user, as the job has
    as_user(monkeypatch, "bob", BOB_PASSWORD)
    assert main(sync) == 0 and Journal(cfg.checkpoint_dir).pending() == []
    client = MlflowClient(auth_server.url)
    run = client.get_run(Journal(cfg.checkpoint_dir).state()["run_id"])
    assert run.info.run_name == cfg.run_name and run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val/loss")] == steps
    assert texts_holding(tmp_path, [BOB_PASSWORD, ADMIN_PASSWORD]) == [str(bob_file)]


def test_a_plain_start_refuses_while_the_auth_server_runs(auth_server):
    out = auth_server._run("start")  # "already running" here would let a user believe the server is open
    assert out.returncode == 2, out.stdout + out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert "running as 'basic-auth', not 'plain'" in line
    assert auth_server._run("start", "--auth").returncode == 0 and auth_server.running()

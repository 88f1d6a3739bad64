"""Session fixtures shared by the test files. Each engineer's block is separated by a banner; add yours
as a new block, never rewrite another's."""

from __future__ import annotations

# ==== mlflow_server (issue 6: tracking) ===================================================================
# One real `mlflow server` on 127.0.0.1 for the session, started and stopped through ops/mlflow_server.sh.
# Tests may stop() and start() it (the outage test does); it restarts on the same port and database.
import os as _ms_os  # noqa: E402
import socket as _ms_socket  # noqa: E402
import subprocess as _ms_subprocess  # noqa: E402
import sys as _ms_sys  # noqa: E402
from pathlib import Path as _MsPath  # noqa: E402

import pytest as _ms_pytest  # noqa: E402

_MS_SCRIPT = _MsPath(__file__).resolve().parent.parent / "ops" / "mlflow_server.sh"


class MlflowServer:
    def __init__(self, folder: _MsPath, port: int):
        self.folder, self.port = folder, port
        self.url = f"http://127.0.0.1:{port}"
        self.env = {
            **_ms_os.environ,
            "MLFLOW_SERVER_DIR": str(folder),
            "MLFLOW_SERVER_PORT": str(port),
            "MLFLOW_SERVER_HOST": "127.0.0.1",
            "PYTHON": _ms_sys.executable,
            "MLFLOW": str(_MsPath(_ms_sys.executable).parent / "mlflow"),
        }

    def _run(self, action: str) -> _ms_subprocess.CompletedProcess:
        return _ms_subprocess.run(
            ["bash", str(_MS_SCRIPT), action], env=self.env, capture_output=True, text=True, timeout=180
        )

    def start(self) -> None:
        out = self._run("start")
        assert out.returncode == 0, f"mlflow server did not start: {out.stdout}{out.stderr}"

    def stop(self) -> None:
        out = self._run("stop")
        assert out.returncode == 0, out.stderr

    def running(self) -> bool:
        return self._run("status").returncode == 0


def _ms_free_port() -> int:
    with _ms_socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@_ms_pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    server = MlflowServer(tmp_path_factory.mktemp("mlflow-server"), _ms_free_port())
    server.start()
    yield server
    server.stop()


# Four real tiny training runs (2 arms x 2 seeds, `prism train` subprocesses, one thread each) logged to
# the session server; uniform seed 2 is stopped after 3 steps by its budget and resumed to 6 (same run id).
TRACKED_STEPS = 6
TRACKED_MILESTONES = [8.6, 8.0, 7.9, 2.0]  # 2.0 is never reached in 6 steps


class TrackedRuns:
    def __init__(self, uri: str, experiment: str, out: _MsPath, overrides: list[str]):
        self.uri, self.experiment, self.out, self.overrides = uri, experiment, out, overrides


@_ms_pytest.fixture(scope="session")
def tracked_runs(tiny_data, mlflow_server, tmp_path_factory):
    out = tmp_path_factory.mktemp("tracked-runs")
    experiment = "tracked-tiny"
    overrides = [
        *tiny_data.overrides,
        "train.batch_tokens=1024",
        "train.micro_batch_size=8",
        "train.val_every=2",
        "train.val_tokens=1024",
        "train.log_every=1",
        "checkpoint.every_steps=3",
        f"tracking.uri={mlflow_server.url}",
        f"tracking.experiment={experiment}",
        f"tracking.milestones={TRACKED_MILESTONES}",
        f"run.output_dir={out}",
    ]
    env = {**_ms_os.environ, "OMP_NUM_THREADS": "1", "MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL": "1"}
    root = _MS_SCRIPT.parent.parent

    def launch(arm: str, seed: int, steps: int) -> tuple[str, _ms_subprocess.Popen]:
        cmd = [
            _ms_sys.executable,
            "-m",
            "pipeline.cli",
            "train",
            f"configs/tiny_{arm}.yaml",
            *overrides,
            f"run.seed={seed}",
            f"train.train_tokens={steps * 1024}",
        ]
        proc = _ms_subprocess.Popen(
            cmd, cwd=root, env=env, stdout=_ms_subprocess.PIPE, stderr=_ms_subprocess.STDOUT, text=True
        )
        return f"{arm} s{seed} ({steps} steps)", proc

    def wait(procs) -> None:
        for name, proc in procs:
            log, _ = proc.communicate(timeout=600)
            assert proc.returncode == 0, f"tiny {name} training failed:\n{log[-3000:]}"

    wait([launch("uniform", 1, TRACKED_STEPS), launch("prism", 1, TRACKED_STEPS), launch("uniform", 2, 3)])
    wait([launch("prism", 2, TRACKED_STEPS), launch("uniform", 2, TRACKED_STEPS)])  # the last one resumes
    return TrackedRuns(mlflow_server.url, experiment, out, overrides)


# ==== end mlflow_server ===================================================================================


# ==== tiny_checkpoints (issue 8: eval + attention distance) ===============================================
# One Prism and one uniform checkpoint of the tiny presets on the tiny_data fixture, each trained for 2
# steps by the real trainer (`prism train` in a subprocess; both at once, one thread each). Each run logs
# to its own SQLite MLflow store (<output_dir>/<arm>/mlflow.db: two processes creating one SQLite store at
# once race in its schema migration), so the checkpoints carry real run ids.
import dataclasses as _ev_dataclasses  # noqa: E402
import os as _ev_os  # noqa: E402
import subprocess as _ev_subprocess  # noqa: E402
import sys as _ev_sys  # noqa: E402
from pathlib import Path as _EvPath  # noqa: E402

import pytest as _ev_pytest  # noqa: E402

_EV_ROOT = _EvPath(__file__).resolve().parent.parent


@_ev_dataclasses.dataclass
class TinyCheckpoints:
    prism: _EvPath  # checkpoint folder (holds `latest`)
    uniform: _EvPath
    overrides: list[str]  # what both runs were trained with, besides run.output_dir=<root>/<arm>

    def tracking_uri(self, arm: str) -> str:
        return f"sqlite:///{getattr(self, arm).parent.parent / 'mlflow.db'}"


@_ev_pytest.fixture(scope="session")
def tiny_checkpoints(tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-checkpoints")
    overrides = [
        *tiny_data.overrides,
        "train.batch_tokens=1024",
        "train.micro_batch_size=8",
        "train.train_tokens=2048",
        "train.val_every=2",
        "train.val_tokens=1024",
        "train.log_every=1",
        "checkpoint.every_steps=2",
        "tracking.system_metrics=false",
    ]
    env = {**_ev_os.environ, "OMP_NUM_THREADS": "1"}
    pipe = dict(cwd=_EV_ROOT, env=env, stdout=_ev_subprocess.PIPE, stderr=_ev_subprocess.STDOUT, text=True)
    train = [_ev_sys.executable, "-m", "pipeline.cli", "train"]
    procs = {
        arm: _ev_subprocess.Popen(
            [*train, f"configs/tiny_{arm}.yaml", *overrides, f"run.output_dir={out / arm}"], **pipe
        )
        for arm in ("prism", "uniform")
    }
    for arm, proc in procs.items():
        log, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"tiny {arm} training failed:\n{log[-3000:]}"
    return TinyCheckpoints(
        out / "prism" / "prism-tiny-s1234" / "checkpoints",
        out / "uniform" / "uniform-tiny-s1234" / "checkpoints",
        overrides,
    )


# ==== end tiny_checkpoints ================================================================================


# ==== tiny_data (issue 3: data prep) ======================================================================
# A real dataset built once per session: a 2.5 MB slice of the embedded corpus (8 FineWeb-schema parquet
# files), an 8k BPE trained on it, and a datatrove LocalPipelineExecutor run (tasks=2) at seq_len=128.
# It yields ~640k tokens: 18 train shards x 16 samples x 16 sequences, 3 val shards x 2 samples.
# Use: config.load("configs/tiny_prism.yaml", tiny_data.overrides + [...]).
from dataclasses import dataclass as _td_dataclass  # noqa: E402
from pathlib import Path as _TdPath  # noqa: E402

import pytest as _td_pytest  # noqa: E402

_TD_ROOT = _TdPath(__file__).resolve().parent.parent
TINY_CORPUS_BYTES = 2_500_000


@_td_dataclass
class TinyData:
    dataset_dir: _TdPath
    tokenizer: _TdPath
    corpus_dir: _TdPath
    overrides: list[str]
    manifest: dict


@_td_pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> TinyData:
    import json

    from data_prep.build import prepare
    from data_prep.corpus import build_embedded_corpus, train_bpe_tokenizer
    from pipeline import config

    root = tmp_path_factory.mktemp("tiny_data")
    corpus = build_embedded_corpus(root / "corpus", max_bytes=TINY_CORPUS_BYTES, num_files=8)
    tokenizer = train_bpe_tokenizer(corpus, root / "bpe8k.json", vocab_size=8192, eos_token="<|endoftext|>")
    overrides = [
        f"data.dataset_dir={root / 'dataset'}",
        f"data.tokenizer={tokenizer}",
        f"data.input={corpus}",
        "model.seq_len=128",
    ]
    manifest_path = prepare(config.load(_TD_ROOT / "configs" / "tiny_prism.yaml", overrides), quiet=True)
    return TinyData(root / "dataset", tokenizer, corpus, overrides, json.loads(manifest_path.read_text()))


# ==== slurm_cluster (issue 7: launchers) ==================================================================
# The real one-node Slurm cluster of ops/local_slurm/start.sh (munge, MariaDB + slurmdbd, slurmctld,
# slurmd), 4 task slots so a 2-job array runs side by side. Stopped at the end only if this session
# started it. Jobs are polled with timeouts (never a bare `sbatch --wait`).
import subprocess as _sc_subprocess  # noqa: E402
import time as _sc_time  # noqa: E402
from pathlib import Path as _ScPath  # noqa: E402

import pytest as _sc_pytest  # noqa: E402

_SC_OPS = _ScPath(__file__).resolve().parent.parent / "ops" / "local_slurm"


class SlurmCluster:
    def sbatch(self, script: str, env: dict[str, str], cwd: _ScPath) -> str:
        out = _sc_subprocess.run(
            ["sbatch", "--parsable", script], env=env, cwd=cwd, capture_output=True, text=True, timeout=30
        )
        assert out.returncode == 0, f"sbatch failed: {out.stderr}"
        return out.stdout.strip().split(";")[0]

    def state(self, job_id: str) -> str:
        """squeue state while queued/running, else '' (gone)."""
        cmd = ["squeue", "-h", "-j", job_id, "-o", "%T"]
        out = _sc_subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        return out.stdout.strip() if out.returncode == 0 else ""

    def wait_gone(self, job_id: str, timeout_s: float) -> None:
        deadline = _sc_time.monotonic() + timeout_s
        while (st := self.state(job_id)) and _sc_time.monotonic() < deadline:
            _sc_time.sleep(0.2)
        if st:
            _sc_subprocess.run(["scancel", job_id], timeout=30)
            raise AssertionError(f"job {job_id} still {st} after {timeout_s} s (cancelled)")

    def sacct(self, job_id: str) -> str:
        """Final state of the job allocation from accounting (lags ~1 s behind completion)."""
        for _ in range(50):
            out = _sc_subprocess.run(
                ["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"], capture_output=True, text=True, timeout=30
            )
            if out.stdout.strip() and out.stdout.split()[0] not in ("RUNNING", "PENDING", "REQUEUED"):
                return out.stdout.split()[0]
            _sc_time.sleep(0.2)
        return out.stdout.strip()


@_sc_pytest.fixture(scope="session")
def slurm_cluster():
    import os

    already_up = _sc_subprocess.run(["bash", "-c", "scontrol ping 2>/dev/null | grep -q UP"]).returncode == 0
    env = {**os.environ, "PRISM_SLURM_CPUS": "4"}
    cmd = ["bash", str(_SC_OPS / "start.sh")]
    out = _sc_subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"ops/local_slurm/start.sh failed:\n{out.stderr[-3000:]}"
    yield SlurmCluster()
    if not already_up:
        _sc_subprocess.run(["bash", str(_SC_OPS / "stop.sh")], env=env, capture_output=True, timeout=120)


# ==== end slurm_cluster ===================================================================================

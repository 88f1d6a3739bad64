"""Launch: where `prism train` runs run, started, watched, stopped and found again one way for every policy.

- ``LocalPool``: commands on this host, at most ``at_once`` side by side, each with its share of the cores
  (the demo's arms, the study's runs).
- ``LocalLauncher`` and ``SlurmLauncher``: one run per record ({key, folder, config, overrides, marker,
  handle}) as a detached subprocess or a submitit job. Each starts a run, tells whether it is alive, stops it
  (the run checkpoints and ends) and finds it again by its marker or job name, so a driver killed at any point
  adopts what it had started (the search).
- ``TrainJob``, ``make_executor`` and ``run_job_name``: the submitit job of one run (torchrun on every node,
  requeued with its checkpoint on time-out or preemption), the executor settings the sweep's jobs share with
  the search's (one running job per name: Slurm's singleton dependency), and a run's job name. A crashed job
  restarts in its allocation, within the bounds of the one restart policy (pipeline/restart.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import submitit

from pipeline import signals
from pipeline.config import ConfigError
from pipeline.distributed import local_run_env
from pipeline.redaction import redact_text
from pipeline.run_lock import proc_start
from pipeline.runs.outcome import EXIT_FILE
from pipeline.runs.plan import train_command
from pipeline.tracking import store

ROOT = Path(__file__).resolve().parents[2]

# How many time-outs a sweep or search job requeues after (submitit's own default is 3). The 757M run is about
# 9 h on 8 GPUs, 3 time-outs of the default 4 h timeout_min, and about 72 h on one GPU, 18; 30 leaves room for
# slower nodes and bigger budgets. A job that stops making progress is ended by the trainer's crash and hang
# handling (docs/cluster.md), not by this bound. Preemptions do not count (submitit requeues those always).
MAX_NUM_TIMEOUT = 30


# --- on this host ---------------------------------------------------------------------------------------
class LocalPool:
    """`prism train` commands on this host, at most ``at_once`` side by side, each with its share of the cores
    (distributed.local_run_env). ``start`` waits for a free slot; ``on_exit(returncode)`` runs when a command
    ends, from ``poll``, ``start`` or ``wait``."""

    def __init__(self, at_once: int, threads: int | None = None):
        self.at_once = at_once
        self.env = local_run_env(at_once, threads)
        self.running: list[tuple[subprocess.Popen, Callable[[int], None]]] = []

    def start(self, cmd: list[str], on_exit: Callable[[int], None], stdout: Any = None) -> subprocess.Popen:
        """``stdout``: None (this console), an open file, or subprocess.PIPE (text lines for the caller)."""
        self.wait_for_slot()
        merged = subprocess.STDOUT if stdout is not None else None
        proc = subprocess.Popen(cmd, env=self.env, stdout=stdout, stderr=merged, text=True, bufsize=1)
        self.running.append((proc, on_exit))
        return proc

    def wait_for_slot(self) -> None:
        while len(self.running) >= self.at_once:
            self.poll()
            time.sleep(0.2)

    def poll(self) -> None:
        for item in list(self.running):
            proc, on_exit = item
            if proc.poll() is not None:
                self.running.remove(item)
                on_exit(proc.returncode)

    def wait(self) -> None:
        while self.running:
            self.poll()
            time.sleep(0.2)


def _find_local(marker: str) -> int | None:
    """A live process whose command line holds ``marker`` (a run's own folder override)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if marker.encode() in args and proc_start(int(entry.name)):
            return int(entry.name)
    return None


class LocalLauncher:
    """`prism train` subprocesses on this host, each in its own session: a driver killed by Ctrl-C or a
    signal leaves them training, and the next driver finds them by pid (and start time) again."""

    def __init__(self, concurrency: int):
        self.children: dict[int, subprocess.Popen] = {}
        self.env = local_run_env(concurrency)

    def find(self, rec: dict[str, Any]) -> dict[str, Any] | None:
        pid = _find_local(rec["marker"])
        return None if pid is None else {"pid": pid, "start": proc_start(pid)}

    def start(self, rec: dict[str, Any]) -> dict[str, Any]:
        folder = Path(rec["folder"])
        folder.mkdir(parents=True, exist_ok=True)
        (folder / EXIT_FILE).unlink(missing_ok=True)
        cmd = train_command(rec["config"], rec["overrides"])
        env = {**self.env, "PRISM_EXIT_FILE": str(folder / EXIT_FILE)}
        with open(folder / "train.log", "a") as log:
            proc = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.children[proc.pid] = proc
        return {"pid": proc.pid, "start": proc_start(proc.pid)}

    def alive(self, rec: dict[str, Any]) -> bool:
        pid = rec["handle"]["pid"]
        if pid in self.children:
            return self.children[pid].poll() is None  # also reaps it
        return proc_start(pid) == rec["handle"]["start"]

    def stop(self, rec: dict[str, Any]) -> None:
        if self.alive(rec):
            with contextlib.suppress(ProcessLookupError):
                os.kill(rec["handle"]["pid"], signal.Signals[signals.ASK_TO_STOP])  # checkpoint, exit 3

    def describe(self, rec: dict[str, Any]) -> str:
        return f"pid {rec['handle']['pid']}"


# --- on Slurm, through submitit -------------------------------------------------------------------------
# Why a TrainJob does not requeue after a stop signal its run checkpointed for: submitit requeues time-outs and
# preemptions itself (``checkpoint``); any other stop (a search pruning the trial, scancel) is meant to end it.
NO_REQUEUE = "submitit requeues time-outs and preemptions itself"


class JobStopped(RuntimeError):
    """A sweep or search job the restart policy stopped; its message is the policy's one line."""


class TrainJob(submitit.helpers.Checkpointable):
    """One run as a submitit job: `prism train CONFIG OVERRIDES` under torchrun on every node of the job."""

    def __init__(
        self,
        config_path: str,
        overrides: list[str],
        nproc_per_node: int = 0,
        grace_s: int = signals.shutdown_grace(signals.DEFAULT_SIGNAL_LEAD_S),
        exit_file: str = "",
    ):
        """``exit_file``: where the run leaves its exit record (default: EXIT_FILE in the run's folder); the
        job's failure history lies next to it."""
        # A job's overrides go into submitit's pickle and onto torchrun's command line (`ps` shows it).
        if held := next((o for o in overrides if redact_text(o) != o), None):
            raise ConfigError(f"{redact_text(held)}: a password in a job's override; {store.CREDENTIALS_ADVICE}")
        self.config_path, self.overrides = config_path, list(overrides)
        self.nproc_per_node, self.grace_s, self.exit_file = nproc_per_node, grace_s, exit_file
        self._proc: subprocess.Popen | None = None

    def __getstate__(self) -> dict[str, Any]:  # the pickle submitit requeues must not hold the live process
        return {k: v for k, v in self.__dict__.items() if k != "_proc"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _proc=None)

    def command(self) -> list[str]:
        dist = submitit.helpers.TorchDistributedEnvironment()  # one task per node: rank = node rank
        nproc = self.nproc_per_node or _gpus_on_node() or 1
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={dist.world_size}",
            f"--node-rank={dist.rank}",
            f"--nproc-per-node={nproc}",
            f"--master-addr={node_address(dist.master_addr)}",
            f"--master-port={dist.master_port}",
            *train_command(self.config_path, self.overrides)[1:],
        ]

    def __call__(self) -> dict[str, Any]:
        """Runs the step, then carries out the restart policy's verdict: restarts it in this allocation, returns
        when done, raises with the verdict's one line otherwise. Time-outs and preemptions never get here:
        submitit calls ``checkpoint`` and requeues the job."""
        from pipeline import config, restart

        cfg = config.load(self.config_path, self.overrides)
        exit_file = Path(self.exit_file) if self.exit_file else cfg.run_dir / EXIT_FILE
        exit_file.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PRISM_EXIT_FILE": str(exit_file)}
        env.update(signals.torchrun_env(self.grace_s))
        environ = dict(os.environ)
        nodes = submitit.helpers.TorchDistributedEnvironment().world_size
        if nodes > 1:  # each node's task would restart its own torchrun, apart from the others
            print(f"sweep job: {nodes} nodes: a failed step is not restarted in this allocation", flush=True)
            environ["PRISM_MAX_RESTARTS"] = "0"
        while True:
            exit_file.unlink(missing_ok=True)
            rc = self._run_step(env)
            record = exit_file.read_text() if exit_file.is_file() else ""
            history = exit_file.with_name(restart.HISTORY_FILE)
            verdict = restart.judge(record, rc, False, history, cfg, environ, NO_REQUEUE)
            print(f"sweep job: {verdict.line}", flush=True)
            if verdict.action == restart.DONE:
                return {"run_name": cfg.run_name, "checkpoint_dir": str(cfg.checkpoint_dir), "exit_code": 0}
            if verdict.action != restart.RESTART:
                raise JobStopped(f"sweep job: {verdict.line}")

    def _run_step(self, env: dict[str, str]) -> int:
        cmd = self.command()
        print("sweep job:", " ".join(cmd), flush=True)
        self._proc = subprocess.Popen(cmd, cwd=ROOT, env=env)
        while (rc := self._proc.poll()) is None:  # poll, not wait(): the signal handler reaps too
            time.sleep(0.5)
        return rc

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        """Called by submitit on global rank 0 when the job is about to time out or is preempted."""
        proc = self._proc
        if proc is not None and proc.returncode is None:
            proc.send_signal(signal.Signals[signals.ASK_TO_STOP])  # torchrun hands it on; the trainer checkpoints
            deadline = time.monotonic() + self.grace_s + 15
            while not _reaped(proc):
                if time.monotonic() > deadline:
                    proc.kill()
                    break
                time.sleep(0.2)
        return super().checkpoint(*args, **kwargs)


def _reaped(proc: subprocess.Popen) -> bool:
    """Whether ``proc`` has exited, reaping it without Popen's lock: this runs in a signal handler that may
    have interrupted the job's own poll() while it held that lock. The same signal from `scancel` often
    reaches torchrun too, so it can already be dead, and reaped by send_signal's own poll()."""
    if proc.returncode is not None:
        return True
    try:
        pid, status = os.waitpid(proc.pid, os.WNOHANG)
    except ChildProcessError:  # reaped elsewhere: nothing is left to wait for
        return True
    if pid:
        proc.returncode = os.waitstatus_to_exitcode(status)
    return bool(pid)


def node_address(node: str) -> str:
    """The address Slurm reaches ``node`` at (its NodeAddr); the name itself where Slurm says nothing.

    On most clusters they are the same; on the local multi-node cluster every node is 127.0.0.1."""
    try:
        out = subprocess.run(["scontrol", "show", "node", node], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return node
    for field in out.stdout.split():
        if field.startswith("NodeAddr="):
            return field.split("=", 1)[1] or node
    return node


def _gpus_on_node() -> int:
    value = os.environ.get("SLURM_GPUS_ON_NODE", "0")
    return int(value) if value.isdigit() else 0


def first_result(job: Any) -> Any:
    """A job's result; a multi-node job has one task per node, all returning the same: take node 0's."""
    return job.results()[0]


def make_executor(
    folder: Path,
    executor: str,
    *,
    nodes: int = 1,
    gpus_per_node: int = 0,
    cpus_per_task: int = 1,
    timeout_min: int = 240,
    partition: str | None = None,
    signal_delay_s: int = signals.DEFAULT_SIGNAL_LEAD_S,
    job_name: str = "prism-sweep",
    additional_parameters: dict[str, Any] | None = None,
    max_num_timeout: int = MAX_NUM_TIMEOUT,
) -> submitit.Executor:
    if executor not in ("slurm", "local"):
        raise ConfigError(f"sweep: executor={executor!r}; use 'slurm' or 'local'")
    if executor == "slurm" and (secret := store.secret_env_name()):
        raise ConfigError(
            f"{secret} is set: sbatch would copy it into every job's environment, which Slurm may store "
            f"(AccountingStoreFlags=job_env); unset it and {store.CREDENTIALS_ADVICE}"
        )
    ex = submitit.AutoExecutor(
        folder=folder / "submitit" / "%j", cluster=executor, slurm_max_num_timeout=max_num_timeout
    )
    params: dict[str, Any] = {
        "nodes": nodes,
        "tasks_per_node": 1,
        "cpus_per_task": cpus_per_task,
        "timeout_min": timeout_min,
        "name": job_name,
        "slurm_signal_delay_s": signal_delay_s,
    }
    if gpus_per_node:
        params["gpus_per_node"] = gpus_per_node
    if partition:
        params["slurm_partition"] = partition
    # one running job per name: a second submission of a run waits (reason Dependency), then resumes
    params["slurm_additional_parameters"] = {"dependency": "singleton", **(additional_parameters or {})}
    if executor == "slurm":
        # srun no longer inherits sbatch's --cpus-per-task (Slurm >= 22.05): the step (torchrun, its workers
        # and their data loaders) would get one CPU per task.
        params["slurm_srun_args"] = [f"--cpus-per-task={cpus_per_task}"]
    ex.update_parameters(**params)
    return ex


def run_job_name(checkpoint_dir: Path, run_name: str) -> str:
    """The Slurm job name of one run: its name and a hash of its checkpoint folder (runs of one name can live
    in several folders, a schedule sweep's), so --dependency=singleton keeps one job per run folder running."""
    digest = hashlib.sha256(str(Path(checkpoint_dir).resolve()).encode()).hexdigest()[:8]
    return f"{run_name}-{digest}"


class SlurmLauncher:
    """One submitit job per run (TrainJob, make_executor's settings); a stopped job is scancel'ed through
    submitit: Slurm sends SIGTERM to its steps, `prism train` checkpoints and ends before the KillWait runs
    out, and the job ends CANCELLED."""

    def __init__(self, folder: Path, name: str, slurm: dict[str, Any], nproc_per_node: int = 0):
        self.folder, self.name, self.slurm, self.nproc_per_node = Path(folder), name, dict(slurm), nproc_per_node
        self.submitit_folder = self.folder / "submitit" / "%j"

    def job_name(self, rec: dict[str, Any]) -> str:
        return f"prism-{self.name}-{rec['key']}"

    def _job(self, rec: dict[str, Any]) -> Any:
        return submitit.SlurmJob(folder=self.submitit_folder, job_id=rec["handle"]["job_id"])

    def find(self, rec: dict[str, Any]) -> dict[str, Any] | None:
        out = subprocess.run(
            ["squeue", "-h", "--name", self.job_name(rec), "-o", "%i"], capture_output=True, text=True, timeout=60
        )
        ids = out.stdout.split()
        return {"job_id": ids[0]} if out.returncode == 0 and ids else None

    def start(self, rec: dict[str, Any]) -> dict[str, Any]:
        grace = signals.shutdown_grace(self.slurm.get("signal_delay_s", signals.DEFAULT_SIGNAL_LEAD_S))
        ex = make_executor(self.folder, "slurm", job_name=self.job_name(rec), **self.slurm)
        exit_file = str(Path(rec["folder"]) / EXIT_FILE)  # where runs.outcome reads how it ended
        Path(exit_file).unlink(missing_ok=True)
        job = ex.submit(TrainJob(rec["config"], rec["overrides"], self.nproc_per_node, grace, exit_file))
        return {"job_id": str(job.job_id)}

    def alive(self, rec: dict[str, Any]) -> bool:
        """Until squeue lets the job go. A cancelled job is CANCELLED in sacct (and so done for submitit) at
        once, while its step still runs: the trainer writing its checkpoint, squeue's COMPLETING. Once
        squeue no longer knows the job (or cannot be asked), submitit's sacct-based answer decides."""
        out = subprocess.run(
            ["squeue", "-h", "-j", rec["handle"]["job_id"], "-o", "%T"], capture_output=True, text=True, timeout=60
        )
        if out.returncode == 0 and out.stdout.strip():
            return True
        return not self._job(rec).done()

    def stop(self, rec: dict[str, Any]) -> None:
        self._job(rec).cancel(check=False)

    def describe(self, rec: dict[str, Any]) -> str:
        return f"job {rec['handle']['job_id']}"

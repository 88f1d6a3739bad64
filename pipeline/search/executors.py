"""Where the search's runs run: `prism train` subprocesses on this host, or submitit jobs on Slurm. Each
launcher starts a run, tells whether it is alive, stops it (a pruned trial checkpoints and ends), and finds
a run again by its marker (a resumed driver adopts runs a killed one started)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

from launchers import sweep
from pipeline.grid import train_command
from pipeline.search.runs import EXIT_FILE
from pipeline.search.spec import SearchSpec


def proc_start(pid: int) -> str | None:
    """The process's start time in clock ticks (field 22 of /proc/PID/stat), None when gone or a zombie:
    with the pid it names one process, so a recycled pid is not taken for a trial."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields[19]


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

    def __init__(self, spec: SearchSpec):
        self.spec = spec
        self.children: dict[int, subprocess.Popen] = {}
        from pipeline.distributed import local_run_env

        self.env = local_run_env(spec.concurrency)

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
                cmd, cwd=sweep.ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
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
                os.kill(rec["handle"]["pid"], signal.SIGUSR1)  # prism train: checkpoint, exit 3

    def describe(self, rec: dict[str, Any]) -> str:
        return f"pid {rec['handle']['pid']}"


class SlurmLauncher:
    """One submitit job per run (the sweep's TrainJob and executor settings); a pruned job is scancel'ed
    through submitit: Slurm sends SIGTERM to its steps, `prism train` checkpoints and ends before the KillWait
    runs out, and the job ends CANCELLED."""

    def __init__(self, spec: SearchSpec):
        self.spec = spec
        self.submitit_folder = spec.folder / "submitit" / "%j"

    def job_name(self, rec: dict[str, Any]) -> str:
        return f"prism-{self.spec.name}-{rec['key']}"

    def _job(self, rec: dict[str, Any]) -> Any:
        import submitit

        return submitit.SlurmJob(folder=self.submitit_folder, job_id=rec["handle"]["job_id"])

    def find(self, rec: dict[str, Any]) -> dict[str, Any] | None:
        out = subprocess.run(
            ["squeue", "-h", "--name", self.job_name(rec), "-o", "%i"], capture_output=True, text=True, timeout=60
        )
        ids = out.stdout.split()
        return {"job_id": ids[0]} if out.returncode == 0 and ids else None

    def start(self, rec: dict[str, Any]) -> dict[str, Any]:
        params = dict(self.spec.slurm)
        grace = max(30, int(params.get("signal_delay_s", 180)) - 30)
        ex = sweep.make_executor(self.spec.folder, "slurm", job_name=self.job_name(rec), **params)
        job = ex.submit(sweep.TrainJob(rec["config"], rec["overrides"], self.spec.nproc_per_node, grace))
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

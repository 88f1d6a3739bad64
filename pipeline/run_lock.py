"""One writer per run: `prism train` holds an exclusive lock on ``<checkpoint_dir>/train.lock`` for its whole
life, so a second trainer on the same folder refuses before it writes anything.

Global rank 0 takes the lock (``fcntl.flock``, which the kernel, or the NFS server once the lease runs out,
drops when the process dies) and writes who holds it into the file: host, pid, process start time, Slurm job.
Every rank learns the verdict from one broadcast right after the process group exists, so no rank touches the
folder, the tracking server or a checkpoint before a refusal. A clean end removes the file; a file left
behind names a holder that died:

- the lock is free and the holder is gone: taken over, with a line saying so;
- the lock is still held but the holder is gone (a dead node whose lock the file server has not dropped yet,
  or a dead trainer's forked child): the file is replaced, with a line saying so;
- the holder may still run: refused in one line naming it (exit 2). That includes a free lock whose holder's
  job still runs on another host: some file systems (Lustre's `localflock`) lock per node only.

"Gone" is decided only where it can be known: on the holder's host, its pid no longer runs that process (the
start time tells a recycled pid); elsewhere, its Slurm job no longer runs (squeue), or it is an earlier start
of this very job.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from pipeline import slurm_job
from pipeline.config import ConfigError

LOCK_FILE = "train.lock"


class RunLocked(ConfigError):
    """Another trainer holds the run folder (one line naming it): exit 2, nothing written."""


def proc_start(pid: int) -> str | None:
    """The process's start time in clock ticks (field 22 of /proc/PID/stat), None when gone or a zombie:
    with the pid it names one process, so a recycled pid is not taken for a live one."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields[19]


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    start: str | None
    job: str | None  # squeue's id of the holder's Slurm job
    since: str

    @classmethod
    def me(cls) -> Holder:
        pid = os.getpid()
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        return cls(socket.gethostname(), pid, proc_start(pid), slurm_job.job_id(), stamp)

    def describe(self) -> str:
        return (
            f"pid {self.pid} on host {self.host}"
            + (f", Slurm job {self.job}" if self.job else "")
            + (f", since {self.since}")
        )

    def gone(self) -> str | None:
        """Why this holder no longer runs, or None while it may."""
        me = Holder.me()
        if self.host == me.host:
            alive = self.start is not None and proc_start(self.pid) == self.start
            return None if alive else f"pid {self.pid} no longer runs on {self.host}"
        if self.job and self.job == me.job:
            return f"it was an earlier start of this Slurm job ({self.job}) on another host"
        if self.job:
            state = slurm_job.job_state(self.job)
            if state is not None and state not in slurm_job.ACTIVE_STATES:
                return f"its Slurm job {self.job} is {state or 'no longer known to Slurm'}"
        return None


def read_holder(fd: int) -> Holder | None:
    """The holder a lock file names; None for an empty or unreadable one."""
    try:
        return Holder(**json.loads(os.pread(fd, 4096, 0)))
    except (OSError, ValueError, TypeError):
        return None


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``fd`` is still the file at ``path`` (a release or a takeover unlinks it)."""
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def refusal(path: Path, holder: Holder | None) -> str:
    who = holder.describe() if holder else "a trainer that has not written its name yet"
    return (
        f"{path.parent}: another `prism train` holds this run folder ({who}); nothing was changed. Wait for "
        f"it to end or cancel it; if it is gone, delete {path}"
    )


def acquire(folder: Path) -> tuple[int, str | None]:
    """Lock ``folder`` for this process: (the lock file's descriptor, a takeover line or None). Raises
    RunLocked when another trainer may hold it."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_FILE
    note = None
    for _ in range(10):  # another process released or replaced the file between open and lock: again
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            locked = True
        except BlockingIOError:
            locked = False
        if not _same_file(fd, path):
            os.close(fd)
            continue
        holder = read_holder(fd)
        why = holder.gone() if holder else None
        if (holder is not None and why is None) or (holder is None and not locked):
            os.close(fd)
            raise RunLocked(refusal(path, holder))
        if holder is not None:
            note = f"took over {path} from {holder.describe()}: {why}"
        if not locked:  # the dead holder's lock lingers on this file: a new file replaces it
            if _same_file(fd, path):  # still it, after the time asking Slurm took
                os.unlink(path)
            os.close(fd)
            continue
        record = json.dumps(asdict(Holder.me())).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, record, 0)
        os.fsync(fd)
        return fd, note
    raise RunLocked(f"{path}: the lock file kept changing under this trainer; another one is starting here")


def release(fd: int, folder: Path) -> None:
    """Remove the lock file (while still holding it), then let go."""
    path = folder / LOCK_FILE
    with contextlib.suppress(OSError):
        if _same_file(fd, path):
            os.unlink(path)
    os.close(fd)


def _new_folders(folder: Path) -> list[Path]:
    """``folder`` and its parents that do not exist yet, deepest first."""
    missing = []
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    return missing


@contextlib.contextmanager
def held(folder: Path) -> Iterator[None]:
    """Hold ``folder``'s lock on global rank 0 for the body; every rank raises ConfigError (exit 2) on a refusal
    or an unwritable folder. A collective: every rank enters it right after the process group is made, before
    writing anything. Folders the lock created are removed again when left empty (a refusal)."""
    import torch.distributed as dist

    from pipeline.checkpoint.restore import check_writable

    verdict: list[str | None] = [None, None]  # [refusal, takeover line]
    fd, created = None, _new_folders(folder)
    if dist.get_rank() == 0:
        try:
            check_writable(folder)  # an unwritable folder is one line, as bad input
            fd, verdict[1] = acquire(folder)
        except ConfigError as e:
            verdict[0] = str(e)
        except OSError as e:  # the folder changed under us (removed, made read-only): still every rank's answer
            verdict[0] = f"{folder}: could not take the run folder's lock ({e}); start again"
    dist.broadcast_object_list(verdict, src=0)
    try:
        if verdict[0] is not None:
            raise ConfigError(verdict[0])
        if verdict[1] and dist.get_rank() == 0:
            print(f"prism train: {verdict[1]}", flush=True)
        yield
    finally:
        if fd is not None:
            release(fd, folder)
        if dist.get_rank() == 0:
            for path in created:
                with contextlib.suppress(OSError):
                    path.rmdir()  # only an empty one

"""Write-then-rename: a reader sees the old file or the whole new one, never a half-written one.

A leaf module (imports nothing of ours) so data_prep, checkpoints, tracking and reports share it.
"""

from __future__ import annotations

import errno
import os
import resource
import tempfile
from pathlib import Path


def write_atomic(path: str | Path, data: bytes | str) -> None:
    """Write ``data`` to a temp file in the same folder, fsync it, then rename it over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp makes 0600 files; give the file the mode open() would (0666 less the umask), so a team
        # sharing a dataset or a run folder can read it, like the weights torch.save writes beside it.
        os.fchmod(fd, 0o666 & ~current_umask())
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def current_umask() -> int:
    """The process umask, read without changing it (Linux /proc), else by setting it and back."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def folder_write_problem(folder: str | Path) -> str | None:
    """Why ``folder`` cannot be created or written to (a temp-file probe), or None when it can."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".write-probe.")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        if e.errno == errno.EEXIST:  # mkdir(exist_ok=True) on a file
            return "it is a regular file, not a folder"
        return write_failure_cause(e, folder)
    return None


def write_failure_cause(e: BaseException, folder: str | Path) -> str:
    """Why a write under ``folder`` failed, in a few words: the OS error if there is one anywhere in the chain
    (torch.save hides it in a RuntimeError; a datatrove worker pool re-raises it in the parent), else what the
    file system and the process limits say."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno is not None:
            return _errno_cause(seen)
        seen = seen.__cause__ or seen.__context__
    try:
        fs = os.statvfs(folder)
        if fs.f_bavail * fs.f_frsize < (16 << 20):
            return "no space left on device"
    except OSError:
        pass
    if (limit := _file_size_limit()) is not None:
        return f"file too large (the process file-size limit, ulimit -f, is {limit} bytes)"
    return str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__


def _errno_cause(e: OSError) -> str:
    if e.errno == errno.ENOSPC:
        return "no space left on device"
    if e.errno == errno.EFBIG and (limit := _file_size_limit()) is not None:
        return f"file too large (the process file-size limit, ulimit -f, is {limit} bytes)"
    if e.errno == errno.ENOTDIR:
        return "a parent of it is a regular file, not a folder"
    return (e.strerror or str(e)).lower()


def _file_size_limit() -> int | None:
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if limit == resource.RLIM_INFINITY else limit

"""Checkpoint saves during training: the clock pipeline.cadence reads (checkpoint.every_minutes), how a save is
written, when it counts, and what a failed one does to the run. The layout and the integrity record are
pipeline.checkpoint's; the commit order is pipeline.checkpoint.commit's.

Non-blocking (``checkpoint.async_save: true``, the default): the step waits only while DeepSpeed's state
dicts are copied to host memory (pipeline.compat.stage_checkpoint_writes; pinned buffers on CUDA, reused);
a thread per rank then writes this rank's files into the tag folder and hashes them. The save commits at
the next sync step where every rank's thread is done (one cheap collective over a CPU group per sync step
while a save is in flight), at the next save, or at the end of the run, whichever comes first: global rank
0 merges the ranks' hashes into the integrity record, writes it, then moves ``latest`` and prunes. So a
reader never sees a tag before its record, and a kill at any moment leaves the previous tag named by
``latest``. At most one save is in flight: a save that comes due before the previous one committed waits
for it, and the console says how long.

Synchronous (``checkpoint.async_save: false``): the same save, written to disk by the calling thread and
settled at once, every rank blocked until ``latest`` moved. Both modes commit through
pipeline.checkpoint.commit.commit_tag, so a tag reads the same however it was written.

Failure policy (both modes): a save that fails on any rank (disk full, I/O error) is removed, one warning
line says why, the run goes on and the next save is attempted. ``checkpoint.max_failed_saves`` failures in a
row, or a failed final or stop-signal save (its steps would be lost), raise InfrastructureFault: exit 5,
which the job script retries from the last intact tag.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline import checkpoint, faults
from pipeline.atomic import write_atomic
from pipeline.checkpoint import commit
from pipeline.checkpoint.restore import TrainState
from pipeline.config import Config
from pipeline.exit_codes import InfrastructureFault


@dataclass
class InFlight:
    """One save from its start to its commit: what it wrote on this rank, and a background save's thread."""

    tag: str
    step: int
    meta: dict[str, Any]
    final: bool
    staged_at: float
    thread: threading.Thread | None = None  # None: a synchronous save, written by the caller
    files: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> {"size", "sha256"}, this rank's
    error: BaseException | None = None


class Saver:
    """Every rank holds one and calls it at the same steps (the loop's sync steps)."""

    def __init__(self, engine: Any, cfg: Config, device: str, clock: Callable[[], float] = time.monotonic) -> None:
        import torch.distributed as dist

        from pipeline import compat

        self.engine, self.cfg = engine, cfg
        self.staging = compat.stage_checkpoint_writes(engine) if cfg.checkpoint.async_save else None
        # the agreements run on CPU tensors: a CUDA flag would wait for the step's kernels
        self.group = dist.new_group(backend="gloo") if device == "cuda" else None
        self.in_flight: InFlight | None = None
        self.failed_in_a_row = 0
        self.clock = clock  # the checkpoint clock (checkpoint.every_minutes); a test may pass its own
        self.last_save = clock()  # the last save's start (or this start: a resume keeps the cadence)
        self.longest_save_s: float | None = None  # staging to commit, the longest in this start (job end time)

    # --- what the loop calls ---------------------------------------------------------------------------
    def since_save(self) -> float:
        """Seconds since the last save started (or this start: a resume keeps the cadence), global rank 0's
        clock, so every rank gets the same reading (a collective). pipeline.cadence decides what it means."""
        import torch
        import torch.distributed as dist

        seconds = torch.tensor([float(self.clock() - self.last_save)], dtype=torch.float64)
        dist.broadcast(seconds, src=0, group=self.group)
        return float(seconds.item())

    def save(self, state: TrainState, final: bool = False) -> None:
        """Start (non-blocking) or write (synchronous) the checkpoint of ``state.step``. ``final``: the run
        ends after it (last step or stop signal), so a failure is not survivable."""
        if self.in_flight is not None:
            waiting_for, t0 = self.in_flight.tag, time.perf_counter()
            self.settle()
            if (waited := time.perf_counter() - t0) >= 0.1:
                say(
                    f"prism train: checkpoint of step {state.step} waited {waited:.1f} s for {waiting_for}'s "
                    f"background write (one save in flight at a time)"
                )
        self.last_save = self.clock()
        job, staged = self._start(state, final)
        self.in_flight = job
        if self.staging is None:  # synchronous: the same save, written here and settled at once
            self._write_here(job, staged)
            self.settle()
            return
        job.thread = threading.Thread(target=self._write, args=(job, staged), name=f"write {job.tag}", daemon=True)
        job.thread.start()
        say(
            f"prism train: checkpoint {job.tag} staged in {time.perf_counter() - job.staged_at:.2f} s, writing in "
            f"the background"
        )

    def poll(self) -> None:
        """At a sync step: commit the save in flight if every rank's write is done (a collective)."""
        if self.in_flight is not None and self._all_done():
            self.settle()

    def final_save_s(self) -> float | None:
        """How long a final save started now may take, by this start's measurements: the save in flight
        finishing first, then its own; None before the first save committed."""
        if self.longest_save_s is None:
            return None
        return self.longest_save_s * (2 if self.in_flight is not None else 1)

    def close(self) -> None:
        """Before exit: wait for the save in flight and commit it (or apply the failure policy)."""
        if self.in_flight is not None:
            self.settle()

    # --- writing ---------------------------------------------------------------------------------------
    def _start(self, state: TrainState, final: bool) -> tuple[InFlight, list[tuple[str, Any]]]:
        """Every rank: DeepSpeed's save of tag ``step-NNNNNNN``, into host memory (staged: the files to write
        are returned) or straight to disk (synchronous); rank 0 adds config.yaml to the files to write."""
        import torch.distributed as dist

        tag, client_state, meta = commit.begin_save(self.cfg, state)
        job = InFlight(tag, state.step, meta, final, time.perf_counter())
        staged: list[tuple[str, Any]] = []
        try:
            self.engine.save_checkpoint(
                str(self.cfg.checkpoint_dir), tag=tag, client_state=client_state, save_latest=False
            )
            staged = self.staging.take_staged() if self.staging is not None else []
        except (OSError, RuntimeError) as e:  # settled like a failed write
            job.error = e
            if self.staging is not None:
                self.staging.take_staged()
            dist.barrier()  # DeepSpeed's closing barrier, which the other ranks wait in, was skipped here
        if dist.get_rank() == 0 and job.error is None:
            staged.append((str(checkpoint.config_file(self.cfg.checkpoint_dir / tag)), self.cfg.dump()))
        return job, staged

    def _write(self, job: InFlight, staged: list[tuple[str, Any]]) -> None:
        """This rank's files (the background thread, or the caller for config.yaml of a synchronous save),
        each hashed after it is written."""
        try:
            for path, content in staged:
                if isinstance(content, str):
                    write_atomic(path, content)
                else:
                    self.staging.write(content, path)
                job.files[Path(path).name] = checkpoint.file_record(Path(path))
                faults.checkpoint_file_written(job.step)
        except BaseException as e:  # reported to every rank at the commit
            job.error = e

    def _write_here(self, job: InFlight, staged: list[tuple[str, Any]]) -> None:
        """A synchronous save's write: config.yaml, then every rank hashes its share of the tag's files
        (DeepSpeed wrote them directly), so the commit has every file's record as after a background write."""
        import torch.distributed as dist

        self._write(job, staged)
        dist.barrier(group=self.group)  # every rank's files are on disk
        if job.error is None:
            try:
                job.files |= checkpoint.hash_share(checkpoint.tag_files(self.cfg.checkpoint_dir / job.tag))
            except OSError as e:
                job.error = e

    # --- commit or fail ----------------------------------------------------------------------------------
    def _all_done(self) -> bool:
        import torch
        import torch.distributed as dist

        done = torch.tensor([float(not self.in_flight.thread.is_alive())])
        dist.all_reduce(done, op=dist.ReduceOp.MIN, group=self.group)
        return bool(done.item())

    def settle(self) -> None:
        """Wait for this rank's write; then, over all ranks, commit the tag (pipeline.checkpoint.commit's one
        order) or remove it (failure policy)."""
        import torch.distributed as dist

        job, self.in_flight = self.in_flight, None
        if job.thread is not None:
            job.thread.join()
        ckpt_dir = self.cfg.checkpoint_dir
        cause = commit.agreed_failure(job.error, ckpt_dir, job.tag, self.group)
        if cause is None:
            parts: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(parts, job.files, group=self.group)
            error = None
            if dist.get_rank() == 0:
                try:
                    commit.commit_tag(self.cfg, job.tag, job.meta, {n: e for part in parts for n, e in part.items()})
                except OSError as e:
                    error = e
            cause = commit.agreed_failure(error, ckpt_dir, job.tag, self.group)
        if cause is not None:
            self._failed(job.tag, cause, job.final)
            return
        self._measured(time.perf_counter() - job.staged_at)
        if job.thread is None:
            say(f"prism train: checkpoint {ckpt_dir / job.tag}")
            return
        say(
            f"prism train: checkpoint {ckpt_dir / job.tag} complete ({time.perf_counter() - job.staged_at:.1f} s "
            f"after staging)"
        )

    def _measured(self, seconds: float) -> None:
        """A save committed in ``seconds`` (for a background one: staging, writing and waiting for the commit)."""
        self.failed_in_a_row = 0
        self.longest_save_s = max(self.longest_save_s or 0.0, seconds)

    def _failed(self, tag: str, cause: str, final: bool) -> None:
        """Every rank, the same arguments: one warning line, or the fault that ends the run."""
        self.failed_in_a_row += 1
        limit = self.cfg.checkpoint.max_failed_saves
        kept = checkpoint.read_latest(self.cfg.checkpoint_dir)
        what = f"checkpoint {tag} failed ({cause}); its partial folder was removed, latest is {kept or 'unset'}"
        if final or self.failed_in_a_row >= limit:
            why = (
                "it was the run's last save"
                if final
                else f"{limit} failed saves in a row (checkpoint.max_failed_saves)"
            )
            raise InfrastructureFault(f"{what}; {why}")
        say(
            f"prism train: warning: {what}; training goes on and the next save is attempted "
            f"({self.failed_in_a_row} of checkpoint.max_failed_saves={limit} in a row)"
        )


def say(text: str) -> None:
    """One console line, from global rank 0 only."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        print(text, flush=True)

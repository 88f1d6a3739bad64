"""Traces and memory snapshots of a live run: on request (a file in the run folder) or for train.profile_steps.

    prism profile RUN_DIR --steps 2 [--memory]     # writes RUN_DIR/profile/request.json; or write it by hand

Global rank 0 looks for ``profile/request.json`` at the loop's sync steps (step_actions' rule) and puts the
step count into the stop agreement's all-reduce, so every rank learns of it in the same step with no extra
collective. The next N steps then run under the torch profiler; every rank writes a gzipped Chrome trace,
``profile/step-A-B/rank-R.json.gz`` (open it at ui.perfetto.dev), and with ``memory`` a CUDA memory snapshot
``rank-R.memory.pickle`` (pytorch.org/memory_viz; on CPU the profiler's per-op memory table,
``rank-R.memory.txt``). Rank 0 logs the files to MLflow under ``profile/step-A-B/`` and renames the request
to ``served.json`` in that folder. On a CUDA out-of-memory error each rank dumps the allocator's state to
``profile/oom-step-S/rank-R.memory.pickle`` before the error ends the run.
"""

from __future__ import annotations

import functools
import gzip
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.atomic import write_atomic

MAX_STEPS = 1000  # a request beyond this is refused: a trace of thousands of steps fills the disk


def profile_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "profile"


def request_path(run_dir: str | Path) -> Path:
    return profile_dir(run_dir) / "request.json"


def window_dir(run_dir: str | Path, first: int, last: int) -> Path:
    return profile_dir(run_dir) / f"step-{first}-{last}"


def write_request(run_dir: str | Path, steps: int, memory: bool = False) -> Path:
    """What `prism profile` writes; a run picks it up at its next sync step."""
    path = request_path(run_dir)
    write_atomic(path, json.dumps({"steps": steps, "memory": memory}) + "\n")
    return path


def read_request(run_dir: str | Path) -> tuple[int, bool] | None:
    """(steps, memory) of a pending request; None when there is none. A request that cannot be served is
    renamed to request.rejected.json with one warning line, so it is not read again at every sync step."""
    path = request_path(run_dir)
    if not path.exists():
        return None
    try:
        body = json.loads(path.read_text())
        steps, memory = body["steps"], body.get("memory", False)
        if not (isinstance(steps, int) and 1 <= steps <= MAX_STEPS and isinstance(memory, bool)):
            raise ValueError
    except (OSError, ValueError, KeyError, TypeError):
        print(
            f"prism train: warning: {path} is not a profile request; write "
            f'{{"steps": N, "memory": false}} with 1 <= N <= {MAX_STEPS} (prism profile RUN_DIR --steps N)',
            flush=True,
        )
        os.replace(path, path.with_name("request.rejected.json"))
        return None
    return steps, memory


def encode(steps: int, memory: bool) -> float:
    """One float for the stop agreement's MAX all-reduce: 0 = no request."""
    return float(2 * steps + int(memory)) if steps else 0.0


def decode(value: float) -> tuple[int, bool]:
    v = int(value)
    return v // 2, bool(v % 2)


@dataclass
class Window:
    first: int
    last: int
    memory: bool
    requested: bool  # from request.json (renamed once served), not from train.profile_steps


class Profiler:
    """One rank's profiler: armed for a window of steps, traces them, writes and logs the files, stops."""

    def __init__(self, cfg: Any, rank: int, device: str, tracker: Any, model: Any = None) -> None:
        self.run_dir, self.rank, self.device, self.tracker, self.model = cfg.run_dir, rank, device, tracker, model
        self.window: Window | None = None
        self.prof: Any = None
        self.labels: Any = None  # the per-layer ranges' hooks, on the model while a window is traced
        steps = cfg.train.profile_steps
        if steps:
            self.window = Window(steps[0], steps[1], cfg.train.profile_memory, requested=False)

    def poll(self, sync_step: bool) -> float:
        """Rank 0, before the stop agreement: a pending request's code (encode), else 0. Reads the folder only
        on sync steps and only while no window is armed."""
        if self.rank != 0 or not sync_step or self.window is not None:
            return 0.0
        found = read_request(self.run_dir)
        return encode(*found) if found else 0.0

    def agreed(self, value: float, step: int, total_steps: int) -> None:
        """Every rank, after the agreement: a request seen at ``step`` traces the next steps (those the run has)."""
        steps, memory = decode(value)
        if steps and self.window is None and step < total_steps:
            self.window = Window(step + 1, min(step + steps, total_steps), memory, requested=True)

    def step(self, step: int) -> Any:
        """A context around one optimizer step: the profiler starts at the window's first step, and each traced
        step is one named range (prism_step#N) in the trace."""
        import contextlib

        import torch

        w = self.window
        if w is not None and step > w.last and self.prof is None:  # a configured window a resume started past
            self.window = w = None
        if w is None or not w.first <= step <= w.last:
            return contextlib.nullcontext()
        if self.prof is None:
            self._start(w)
        return torch.profiler.record_function(f"prism_step#{step}")

    def step_done(self, step: int) -> None:
        if self.prof is not None and self.window is not None and step >= self.window.last:
            self._finish(self.window)

    def cut(self, step: int) -> None:
        """A stop signal inside a window: the steps traced so far are written (every rank stops at this step)."""
        if self.prof is not None and self.window is not None:
            self.window.last = step
            self._finish(self.window)

    def _start(self, w: Window) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device == "cuda" else [])
        if w.memory and self.device == "cuda":
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        self.prof = profile(activities=activities, profile_memory=w.memory, record_shapes=w.memory)
        self.prof.__enter__()
        if self.model is not None:
            self.labels = label_layers(self.model)

    def _finish(self, w: Window) -> None:
        import torch.distributed as dist

        self.prof.__exit__(None, None, None)
        for handle in self.labels or ():
            handle.remove()
        folder = window_dir(self.run_dir, w.first, w.last)
        try:
            write_trace(self.prof, folder / f"rank-{self.rank}.json.gz")
            if w.memory:
                write_memory(self.prof, folder, self.rank, self.device)
        except OSError as e:  # a full disk loses the trace, never the run
            print(f"prism train: warning: rank {self.rank}: profile not written to {folder} ({e})", flush=True)
        self.prof, self.window = None, None
        dist.barrier()  # every rank's files are on disk before rank 0 lists and logs them
        if self.rank == 0:
            if w.requested and request_path(self.run_dir).exists():
                os.replace(request_path(self.run_dir), folder / "served.json")
            log_window(self.tracker, folder)
            print(f"prism train: profile of steps {w.first}-{w.last} written to {folder}", flush=True)


def layer_range(layer: int, phase: str) -> str:
    return f"layer{layer:02d}.{phase}"


def label_layers(model: Any) -> list[Any]:
    """Named profiler ranges around each transformer layer's forward and backward (layer01.forward, ...);
    returns the hook handles. Only while tracing, and removed after. The backward range opens when the layer's
    output gradient arrives and closes when its input gradient leaves: identity autograd marks on the layer's
    hidden states (megatron passes them as a keyword, which module backward hooks do not see)."""
    import re

    import torch

    def enter(name, module):
        def hook(mod, args, kwargs):
            module._prism_ranges = [torch.ops.profiler._record_function_enter_new(name)]
            if isinstance(kwargs.get("hidden_states"), torch.Tensor):  # its gradient ends the layer's backward
                kwargs = {**kwargs, "hidden_states": _mark_class().apply(kwargs["hidden_states"], module, None)}
            return args, kwargs

        return hook

    def leave(backward_name):
        def hook(module, args, kwargs, output):
            torch.ops.profiler._record_function_exit(module._prism_ranges.pop())
            first = output[0] if isinstance(output, tuple) else output
            marked = _mark_class().apply(first, module, backward_name)  # its gradient starts the layer's backward
            return (marked, *output[1:]) if isinstance(output, tuple) else marked

        return hook

    handles = []
    for name, module in model.named_modules():
        if m := re.fullmatch(r"(?:.*\.)?decoder\.layers\.(\d+)", name):
            i = int(m[1]) + 1
            handles += [
                module.register_forward_pre_hook(enter(layer_range(i, "forward"), module), with_kwargs=True),
                module.register_forward_hook(leave(layer_range(i, "backward")), with_kwargs=True),
            ]
    return handles


@functools.cache
def _mark_class() -> Any:
    import torch

    class Mark(torch.autograd.Function):
        """Identity; its backward opens a range (``name``) or closes the module's open one (``name`` None)."""

        @staticmethod
        def forward(ctx, x, module, name):
            ctx.module, ctx.name = module, name
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            if ctx.name is not None:
                ctx.module._prism_backward = torch.ops.profiler._record_function_enter_new(ctx.name)
            elif getattr(ctx.module, "_prism_backward", None) is not None:
                torch.ops.profiler._record_function_exit(ctx.module._prism_backward)
                ctx.module._prism_backward = None
            return grad, None, None

    return Mark


def layer_times(prof: Any, device: str) -> dict[int, dict[str, float]]:
    """{layer: {"forward": ms, "backward": ms}} summed over the traced steps: the ranges' wall time on CPU,
    the device time of the kernels launched inside them on CUDA."""
    import re

    times: dict[int, dict[str, float]] = {}
    for event in prof.key_averages():
        if m := re.fullmatch(r"layer(\d+)\.(forward|backward)", event.key):
            us = event.device_time_total if device == "cuda" else event.cpu_time_total
            times.setdefault(int(m[1]), {})[m[2]] = us / 1e3
    return dict(sorted(times.items()))


def write_trace(prof: Any, path: Path) -> Path:
    """The profiler's Chrome trace, gzipped, written whole or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".trace-") as tmp:
        raw = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(raw))
        write_atomic(path, gzip.compress(raw.read_bytes(), compresslevel=6))
    return path


def write_memory(prof: Any, folder: Path, rank: int, device: str) -> Path:
    """CUDA: the allocator snapshot with the window's allocation history (memory_viz reads it). CPU: no such
    allocator; the profiler's per-op memory table instead."""
    if device == "cuda":
        return dump_snapshot(folder / f"rank-{rank}.memory.pickle", stop_history=True)
    path = folder / f"rank-{rank}.memory.txt"
    write_atomic(path, prof.key_averages().table(sort_by="self_cpu_memory_usage", row_limit=30) + "\n")
    return path


def dump_snapshot(path: Path, stop_history: bool = False) -> Path:
    """torch.cuda.memory's snapshot (segments, blocks and, if recorded, the allocation history), atomically."""
    import pickle

    import torch

    if not torch.cuda.is_available():  # torch's own error here names a missing private binding
        raise RuntimeError(
            "a memory snapshot needs a CUDA device (torch.cuda's caching allocator); this process has none"
        )
    snapshot = torch.cuda.memory._snapshot()
    if stop_history:
        torch.cuda.memory._record_memory_history(enabled=None)
    write_atomic(path, pickle.dumps(snapshot))
    return path


def dump_on_oom(run_dir: str | Path, step: int, rank: int) -> Path | None:
    """A CUDA out-of-memory error's snapshot, before the error ends the run; None if even that fails."""
    path = profile_dir(run_dir) / f"oom-step-{step}" / f"rank-{rank}.memory.pickle"
    try:
        dump_snapshot(path)
    except Exception as e:  # the OOM is the error to report, not a failed snapshot of it
        print(f"prism train: rank {rank}: no memory snapshot after the OOM ({e})", flush=True)
        return None
    print(f"prism train: rank {rank}: out of memory at step {step}; allocator snapshot {path}", flush=True)
    return path


def log_window(tracker: Any, folder: Path) -> None:
    """Rank 0: every file of the window to MLflow under profile/<window>/; a failure is a warning, never the
    end of training (the files stay in the run folder)."""
    try:
        for path in sorted(folder.glob("rank-*")):
            tracker.log_artifact_text(path.read_bytes(), f"profile/{folder.name}/{path.name}")
    except Exception as e:
        print(f"prism train: warning: profile files not logged to MLflow ({e}); they are in {folder}", flush=True)

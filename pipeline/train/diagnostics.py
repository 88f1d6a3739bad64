"""What the loop measures and reports: MFU, memory, the steps whose losses are still on the device, one log
line per logged step, the nonfinite report, and the data checks before the first step."""

from __future__ import annotations

import json
import resource
import sys
import time
from collections import deque
from typing import Any

import numpy as np

from pipeline import budget, checkpoint, model_size
from pipeline.atomic import write_atomic
from pipeline.checkpoint.restore import TrainState
from pipeline.config import Config
from pipeline.console import Pace, duration
from pipeline.dataset import DataError, read_shard
from pipeline.train.engine import StepResult

# --- schedule and optimizer -----------------------------------------------------------------------------
# The LR is a function of the step alone; its formulas live in pipeline.lr_schedule (plan draws the same curve).


# --- measurements -------------------------------------------------------------------------------------
def mfu(cfg: Config, tokens_per_sec: float, peak: float | None, gpus: int) -> dict[str, float]:
    """perf/mfu (attention's matmuls counted in full, pipeline.model_size) and perf/mfu_causal (halved for the
    causal mask, Megatron's / llm.c's convention; pipeline.hardware explains both); none without a peak."""
    if not peak:
        return {}
    full, causal = model_size.flops_per_token(cfg), model_size.flops_per_token(cfg, causal=True)
    return {
        "perf/mfu": full * tokens_per_sec / (peak * gpus),
        "perf/mfu_causal": causal * tokens_per_sec / (peak * gpus),
    }


def memory_gb(device: str) -> float:
    if device == "cuda":
        import torch

        return torch.cuda.max_memory_allocated() / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux: peak RSS


class UnreadSteps:
    """Steps trained since the last sync step, their losses still on the device. ``max_skips_in_a_row``:
    train.max_skips_in_a_row, where a run of skipped steps ends the run."""

    def __init__(self, max_skips_in_a_row: int = 1) -> None:
        self.steps: list[tuple[int, StepResult]] = []
        self.since = time.perf_counter()
        self.seconds = 0.0  # the steps of the last read-back: their wall time, the run's one training clock
        self.max_skips_in_a_row = max_skips_in_a_row
        self.skipped: list[tuple[int, StepResult]] = []  # the skipped steps of the last read-back

    def add(self, step: int, result: StepResult) -> None:
        self.steps.append((step, result))

    def restart_clock(self) -> None:
        """After a sync step's validation, log and checkpoint: the next steps' time is training time only."""
        self.since = time.perf_counter()

    def read_back(self, recent: deque[float]) -> tuple[int, StepResult] | None:
        """Floats for every unread step; returned: the first step that ends the run, a non-finite one that was
        not skipped or the last of max_skips_in_a_row skips in a row. Each step's time becomes the mean wall time
        since the last sync, the only honest figure once kernels run async."""
        steps, self.steps, self.skipped = self.steps, [], []
        now = time.perf_counter()
        self.seconds = now - self.since
        for step, result in steps:
            result.read_back()
            result.seconds = self.seconds / len(steps)
            if result.skipped:
                self.skipped.append((step, result))
            if (not result.finite and not result.skipped) or result.skips_in_a_row >= self.max_skips_in_a_row:
                return step, result
            if result.finite:
                recent.append(result.loss)
        self.since = now
        return None


def log_step(
    cfg: Config,
    tracker: Any,
    state: TrainState,
    total_steps: int,
    result: StepResult,
    val_losses: dict[str, float],
    device: str,
    pace: Pace | None = None,
    stragglers: dict[str, float] | None = None,
) -> None:
    """Metrics to the tracker and, on rank 0, one console line; its train tok/s and ETA are ``pace``'s (the
    training rate over the steps since the last line, console.Progress); ``stragglers``: the slowest rank's
    numbers (pipeline.stragglers), named on the line when it is notably slower. ``val_losses``: metric -> loss of
    each validation set scored at this step (none: not a validation step)."""
    import torch.distributed as dist

    from pipeline.stragglers import straggler_note

    tok_s = cfg.train.batch_tokens / result.seconds
    from pipeline.hardware import device_peak_flops

    peak = device_peak_flops(cfg.train.peak_flops, device)  # the table's, or train.peak_flops
    utilisation = mfu(cfg, tok_s, peak, dist.get_world_size())
    metrics = {
        "train/loss": result.loss,
        "train/lr": result.lr,
        "train/grad_norm": result.grad_norm,
        "train/tokens_seen": state.tokens_seen,
        "perf/train_tokens_per_sec": tok_s,
        "perf/step_time": result.seconds,
        "perf/memory_gb": memory_gb(device),
        "train/skipped_steps": result.skipped_total,
    }
    metrics.update(val_losses)
    metrics.update(utilisation)
    metrics.update(stragglers or {})
    tracker.log_metrics(metrics, state.step)
    if dist.get_rank() == 0:
        timing = ""
        if pace is not None:
            tok_s = pace.train_tokens_per_sec
            timing = f" | {duration(pace.elapsed)} elapsed, ETA {duration(pace.eta)}"
        print(
            f"step {state.step:>6}/{total_steps} | tokens {state.tokens_seen:,} | loss {result.loss:.4f}"
            + "".join(f" | {name.removesuffix('/loss')} {v:.4f}" for name, v in val_losses.items())
            + f" | lr {result.lr:.3e} | grad_norm {result.grad_norm:.3f} | {tok_s:,.0f} train tok/s"
            + timing
            + (f" | mfu {100 * utilisation['perf/mfu']:.1f}%" if utilisation else "")
            + f" | mem {metrics['perf/memory_gb']:.2f} GB"
            + (f" | skipped {result.skipped_total}" if result.skipped_total else "")
            + straggler_note(metrics),
            flush=True,
        )


def report_nonfinite(cfg: Config, step: int, result: StepResult, recent: deque[float]) -> None:
    """Diagnostic for the step that ends a run of skipped steps (or a NaN/inf step nothing skipped): numbers as
    JSON, this rank's batches of the step as .npz; one error line."""
    import torch.distributed as dist

    info = {
        "step": step,
        "train_loss": result.loss,
        "grad_norm": result.grad_norm,
        "skips_in_a_row": result.skips_in_a_row,
        "skipped_steps": result.skipped_total,
        "lr": result.lr,
        "micro_losses": [float(x) for x in result.micro_losses],
        "recent_losses": list(recent),
        "loader_position_before_step": result.position_before,
        "last_good_checkpoint": checkpoint.latest_tag(cfg.checkpoint_dir),
    }
    path = cfg.checkpoint_dir / f"nonfinite-step-{step:07d}-rank{dist.get_rank()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path.with_suffix(".npz"), *result.batches)
    write_atomic(path, json.dumps(info, indent=1, default=str))
    if dist.get_rank() == 0:
        what = f"loss {result.loss} / grad norm {result.grad_norm} at step {step}"
        if result.skips_in_a_row:
            what = (
                f"{result.skips_in_a_row} steps in a row skipped (train.max_skips_in_a_row), non-finite or spiking "
                + what
            )
        else:
            what = f"non-finite {what}"
        print(
            f"prism train: error: {what}; "
            f"diagnostics in {path}; last good checkpoint {info['last_good_checkpoint']} is kept "
            f"(lower train.lr with checkpoint.allow_changes=[train.lr], or check the data, then resume)",
            file=sys.stderr,
            flush=True,
        )


def check_data_before_start(cfg: Config, manifest: dict[str, Any], dp_size: int) -> float:
    """Refuse a budget beyond one epoch (unless data.allow_repeat) and, per data.verify_on_start, hash every
    shard: each rank a disjoint slice, every rank raises the first problem any rank found. Returns the epochs."""
    import torch.distributed as dist

    epochs = budget.check_epochs(cfg, manifest, dp_size)
    if budget.should_verify_on_start(cfg, manifest):
        rank, world = dist.get_rank(), dist.get_world_size()
        entries = [(split, e) for split in manifest["splits"] for e in manifest["splits"][split]["shards"]]
        problem = None
        for split, entry in entries[rank::world]:
            try:
                read_shard(cfg.data.dataset_dir, manifest, split, entry)
            except DataError as e:
                problem = str(e)
                break
        found: list[str | None] = [None] * world
        dist.all_gather_object(found, problem)
        if first := next((p for p in found if p), None):
            raise DataError(f"data.verify_on_start: {first}")
        if rank == 0:
            print(f"prism train: data.verify_on_start: {len(entries)} shards match the manifest", flush=True)
    return epochs


def say(text: str) -> None:
    """One console line, from global rank 0 only."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        print(text, flush=True)

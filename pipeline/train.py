"""The training loop: DeepSpeed ZeRO engine around a Megatron-core GPTModel, nanoGPT-style.

    prism train CONFIG [overrides]            # one process
    torchrun --nproc-per-node N -m pipeline.cli train CONFIG ...   # N processes (TP x DP)

Read it bottom up: `train` refuses bad input and decides where to resume (pipeline.checkpoint), `setup` builds
the Run (`load_data`; `build_start`: model, engine, initial weights; `start_tracker`), `loop` trains it,
`finish` closes it. In the loop, `train_step` is one optimizer step, `step_actions` says what else the step
does (sync, validate, log, checkpoint), `do_step_actions` does it and `log_step` writes one log line. Process
groups and collectives are in pipeline.distributed, what a checkpoint holds in pipeline.checkpoint.

Why it is over 400 lines: it is one job, the training path from refusing bad input to the final summary,
and the engine the loop drives (AdamW, LR schedule, DeepSpeed config: about 90 lines) stays beside the step
that uses it, because benchmarks/bench_arms.py patches `train_step` here and reads the optimizer line from
this module's logger.
"""

from __future__ import annotations

import json
import logging
import math
import resource
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline import budget, checkpoint, data, faults, lr_schedule, model_size, run_lock, slurm_job
from pipeline.atomic import write_atomic
from pipeline.cadence import StepActions, step_actions
from pipeline.checkpoint import restore
from pipeline.checkpoint.restore import TrainState
from pipeline.checkpoint.writer import Saver
from pipeline.config import Config
from pipeline.console import Pace, Progress, duration
from pipeline.dataset import DataError, read_shard
from pipeline.distributed import (
    HangWatch,
    StopSignal,
    deepspeed_device_args,
    diagnostics_dir,
    dp_sum,
    init_distributed,
    init_model_parallel,
    train_device,
)
from pipeline.eval.catalog import eval_tokens
from pipeline.exit_codes import (
    EXIT_CRASHED,
    EXIT_FINISHED,
    EXIT_INFRA,
    EXIT_NONFINITE,
    EXIT_STOPPED,
    RECORD_REASONS,
    InfrastructureFault,
)
from pipeline.metric_names import val_loss_metric

# --- schedule and optimizer -----------------------------------------------------------------------------
# The LR is a function of the step alone; its formulas live in pipeline.lr_schedule (plan draws the same curve).
lr_at = lr_schedule.lr_at


def param_groups(model: Any, weight_decay: float) -> list[dict[str, Any]]:
    """nanoGPT's split (the codebase the paper extends): every parameter with >= 2 dims decays, the (tied)
    token embedding included; only 1-dim ones (biases, norm weights) don't."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def make_optimizer(cfg: Config, model: Any) -> Any:
    from pipeline import compat

    t = cfg.train
    # A client torch AdamW: DeepSpeed's own "AdamW" would JIT-build FusedAdam (~80 s) and differs per device.
    # Under ZeRO-1/2 DeepSpeed swaps each group's params for one flat fp32 partition and steps THIS optimizer
    # on it (stage_1_and_2.py: optimizer.param_groups[i]["params"] = [flat fp32 partition]), so a fused
    # AdamW runs one kernel over each flat group. Fused on CPU too: it is the kernel that can skip a step on
    # the device (pipeline.skipping), and ~10x faster than the per-tensor loop there (32 -> 3.4 ms per step
    # over 5M fp32 values on 2 cores; the two differ by an ulp).
    return compat.SkipStepAdamW(
        param_groups(model, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, fused=True
    )


# --- the engine ----------------------------------------------------------------------------------------
def deepspeed_config(cfg: Config, grad_accum: int, dp_size: int, load_universal: bool = False) -> dict[str, Any]:
    """load_universal: the resume loads a checkpoint converted for another TP/DP size (pipeline.checkpoint.reshard)."""
    t = cfg.train
    return {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        "train_batch_size": t.micro_batch_size * grad_accum * dp_size,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": {"stage": cfg.parallel.zero_stage},
        "bf16": {"enabled": t.precision == "bf16", "check_grad_overflow": False},  # no per-step NaN read-back
        # bf16 like the paper's codebase (and Megatron's default under bf16): fp32 master weights, micro-batch
        # gradients summed in fp32 and all-reduced over DP in fp32, so a step does not depend on how many
        # micro-batches or GPUs make it up (DeepSpeed would all-reduce in bf16; an elastic resume then drifts)
        **(
            {"data_types": {"grad_accum_dtype": "fp32"}, "communication_data_type": "fp32"}
            if t.precision == "bf16"
            else {}
        ),
        "zero_allow_untested_optimizer": True,  # the client torch AdamW
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
        "timers": {"throughput": {"enabled": False}},  # else a device synchronize in every forward and step
        **({"checkpoint": {"load_universal": True}} if load_universal else {}),
    }


def build_engine(
    cfg: Config, model: Any, grad_accum: int, dp_size: int, load_universal: bool = False, skipper: Any = None
) -> tuple[Any, Any]:
    """skipper: a pipeline.skipping.StepSkipper that decides, inside each optimizer step, whether it is skipped."""
    from pipeline import compat

    deepspeed = compat.import_deepspeed()
    optimizer = make_optimizer(cfg, model)
    engine, *_ = deepspeed.initialize(
        args=deepspeed_device_args(),  # this worker's GPU, not LOCAL_RANK (one GPU per Slurm task)
        model=model,
        optimizer=optimizer,
        mpu=compat.MegatronMpu(),
        config=deepspeed_config(cfg, grad_accum, dp_size, load_universal),
    )
    compat.remove_host_syncs(engine.optimizer)  # DeepSpeed's step reads the grad norm on the host otherwise
    if skipper is not None:  # asked when DeepSpeed has the step's grad norm and calls the torch optimizer
        optimizer.skip_flag = lambda: skipper.decide(compat.pre_step_grad_norm(engine.optimizer))
    logging.getLogger(__name__).info("optimizer: %s", optimizer_stepped(engine, optimizer))
    return engine, optimizer


def optimizer_stepped(engine: Any, optimizer: Any) -> str:
    """What DeepSpeed actually steps: its wrapper, the torch optimizer's kernels and the tensors per group."""
    impl = "fused" if optimizer.defaults.get("fused") else "foreach" if optimizer.defaults.get("foreach") else "loop"
    groups = [len(g["params"]) for g in optimizer.param_groups]
    return f"{type(engine.optimizer).__name__} -> torch AdamW ({impl}) over {groups} tensors per param group"


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


def evaluate(engine: Any, val_rows: np.ndarray, micro: int, device: str) -> tuple[float, np.ndarray]:
    """Mean loss over the fixed val rows, and each row's mean loss in row order (float64, on every rank); rows
    are dealt to DP ranks round-robin, TP peers share them."""
    import torch
    from megatron.core import parallel_state

    from pipeline.model import lm_loss

    rank, size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    mine = val_rows[rank::size]
    total = torch.zeros(2, dtype=torch.float64, device=device)
    per_row = torch.zeros(len(val_rows), dtype=torch.float64, device=device)  # zeros where other ranks' rows go
    engine.eval()
    with torch.no_grad():
        for i in range(0, len(mine), micro):
            tokens = torch.from_numpy(mine[i : i + micro].astype(np.int64)).to(device)
            token_losses = torch.empty(tokens.numel() - len(tokens), dtype=torch.float32, device=device)
            total[0] += lm_loss(engine, tokens, token_losses=token_losses).double() * len(tokens)
            total[1] += len(tokens)
            rows = rank + size * (i + torch.arange(len(tokens), device=device))  # their places in val_rows
            per_row[rows] = token_losses.view(len(tokens), -1).double().mean(1)
    engine.train()
    dp_sum(total)  # as before: the scalar's sum is not part of the vector's all-reduce
    dp_sum(per_row)
    return float(total[0] / total[1]), per_row.cpu().numpy()


# --- one step, its log line, the loop ---------------------------------------------------------------
@dataclass
class StepResult:
    loss: float  # mean over the step's micro-batches and the DP ranks
    grad_norm: float
    lr: float
    seconds: float
    # this rank's micro-batch losses, batches and loader position before the step: a NaN step's diagnostic
    micro_losses: list[Any]
    batches: list[np.ndarray]
    position_before: dict[str, Any]
    # pipeline.skipping: whether this step's update was skipped, the skips in a row ending here, all so far
    skipped: Any = 0.0
    skips_in_a_row: Any = 0
    skipped_total: Any = 0

    @property
    def finite(self) -> bool:
        self.read_back()
        return math.isfinite(self.loss) and math.isfinite(self.grad_norm)

    def read_back(self) -> StepResult:
        """The step's numbers to host floats: its one host sync, done on sync steps only."""
        names = ("loss", "grad_norm", "skipped", "skips_in_a_row", "skipped_total")
        if not all(isinstance(getattr(self, n), float | int) for n in names):
            import torch

            values = [torch.as_tensor(getattr(self, n), dtype=torch.float32) for n in names]
            host = torch.stack([v.to(values[0].device) for v in values]).tolist()
            self.loss, self.grad_norm = host[:2]
            self.skipped, self.skips_in_a_row, self.skipped_total = (int(v) for v in host[2:])
        return self


def train_step(
    engine: Any,
    optimizer: Any,
    loader: Any,
    lr: float,
    grad_accum: int,
    device: str,
    skipper: Any = None,
    z_loss: float = 0.0,
    loss_fault: float | None = None,
    clock: Any = None,
) -> StepResult:
    """One optimizer step: ``grad_accum`` micro-batches forward and backward, DeepSpeed's clipped update, which
    ``skipper`` (pipeline.skipping) may skip on the device. ``loss_fault``: a test's factor on the loss
    (pipeline.faults); ``clock``: a pipeline.stragglers.RankClock timing this rank's data fetch and forward."""
    import contextlib

    import torch
    from megatron.core import parallel_state

    from pipeline.model import lm_loss

    t0 = time.perf_counter()
    for group in optimizer.param_groups:
        group["lr"] = lr
    position_before = loader.state_dict()
    batches, micro_losses = [], []
    untimed = contextlib.nullcontext()
    for i in range(grad_accum):
        with clock.data() if clock else untimed:
            batch = loader.next_batch()
        batches.append(batch)
        # pinned by the loader on CUDA: the copy overlaps the previous micro-batch's kernels
        with clock.forward() if clock else untimed:
            loss = lm_loss(engine, torch.from_numpy(batch).to(device, non_blocking=True), z_loss)
        if loss_fault is not None:
            loss = loss * loss_fault
        engine.backward(loss)
        micro_losses.append(loss.detach())
        if i == grad_accum - 1:
            # Device tensors, no host sync here: StepResult.read_back() turns them into floats on sync steps.
            mean_loss = dp_sum(torch.stack(micro_losses).float().mean()) / parallel_state.get_data_parallel_world_size()
            if skipper is not None:
                skipper.arm(mean_loss)  # before the boundary step below runs the optimizer
        engine.step()  # DeepSpeed applies the update at the accumulation boundary only
    if clock:
        clock.step_done()
    grad_norm = engine.get_global_grad_norm()
    grad_norm = torch.zeros((), device=device) if grad_norm is None else grad_norm
    result = StepResult(mean_loss, grad_norm, lr, time.perf_counter() - t0, micro_losses, batches, position_before)
    if skipper is not None:
        result.skipped = skipper.finish(engine.get_global_grad_norm())
        result.skips_in_a_row, result.skipped_total = skipper.in_a_row.clone(), skipper.total.clone()
    return result


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


def stop_agreement(stopper: StopSignal, device: str) -> Any:
    """A per-step check that all ranks agree to stop, without a device sync: on CUDA over a gloo group
    of CPU tensors (reading a CUDA flag would wait for the step's kernels)."""
    if device != "cuda":
        return lambda news=0.0: stopper.agreed(device, news=news)
    import torch.distributed as dist

    group = dist.new_group(backend="gloo")
    return lambda news=0.0: stopper.agreed("cpu", group=group, news=news)


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
    """Metrics to the tracker and, on rank 0, one console line; its tok/s and ETA are ``pace``'s (the
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
        "perf/tokens_per_sec": tok_s,
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
            tok_s = pace.tokens_per_sec
            timing = f" | {duration(pace.elapsed)} elapsed, ETA {duration(pace.eta)}"
        print(
            f"step {state.step:>6}/{total_steps} | tokens {state.tokens_seen:,} | loss {result.loss:.4f}"
            + "".join(f" | {name.removesuffix('/loss')} {v:.4f}" for name, v in val_losses.items())
            + f" | lr {result.lr:.3e} | grad_norm {result.grad_norm:.3f} | {tok_s:,.0f} tok/s"
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


# --- setup, the loop, the end ---------------------------------------------------------------------------
@dataclass
class Run:
    """Everything the loop needs, made once by ``setup``; the loop moves ``state`` and the two losses."""

    cfg: Config
    engine: Any
    optimizer: Any
    loader: Any
    val_sets: dict[str, np.ndarray]  # metric (val/loss, val/<name>/loss) -> the set's fixed rows
    tracker: Any
    stopper: StopSignal
    state: TrainState
    device: str
    total_steps: int
    warmup: int
    grad_accum: int
    saver: Any = None  # pipeline.checkpoint.writer.Saver
    skipper: Any = None  # pipeline.skipping.StepSkipper
    clock: Any = None  # pipeline.stragglers.RankClock
    node_metrics: Any = None  # pipeline.tracking.system.NodeMetrics on the first rank of nodes but rank 0's
    watch: HangWatch | None = None  # per-rank stacks on a hang, the collective timeouts
    train_loss: float = float("nan")  # of the last sync step
    val_loss: float | None = None  # of the last validation
    evals: Any = None  # pipeline.eval.in_run.DownstreamEval when train.eval_every is set
    profiler: Any = None  # pipeline.profiling.Profiler: traces on request or for train.profile_steps
    job_end: Any = None  # pipeline.slurm_job.JobEnd on global rank 0 of a Slurm job with an end time


def train(cfg: Config) -> dict[str, Any]:
    """Train (or resume) ``cfg`` inside the current process group; returns a summary with ``exit_code``."""
    # Refuse bad input before anything expensive: a changed config on resume, a mismatched dataset.
    slurm_job.max_batch_requeue_override()  # a bad PRISM_MAX_BATCH_REQUEUE: one line on every rank
    from pipeline.model.gpt import check_spec

    check_spec(cfg)  # model.spec=transformer_engine where TE cannot run: one line, before any process group
    # the resume checks share the checkpoint hashing out over the ranks
    init_distributed(cfg.train.device, cfg.parallel.init_timeout_s)
    with run_lock.held(cfg.checkpoint_dir):  # one writer per run: a refusal reaches every rank before any write
        return train_held(cfg)


def train_held(cfg: Config) -> dict[str, Any]:
    """``train`` with the run folder's lock held (pipeline.run_lock)."""
    from pipeline import compat
    from pipeline.config import ConfigError

    resume = branch_start(cfg) or restore.resume_point(cfg)
    if resume.finished:
        return already_finished(cfg, resume)
    run = setup(cfg, resume)
    try:
        exit_code = loop(run)
        run.saver.close()  # the final or stop-signal save (or an earlier one still in flight) commits first
    except ConfigError:
        raise  # bad input met mid-run (a damaged shard): exit 2, recorded by the CLI, never retried
    except Exception as error:  # a lost peer or timed-out collective is the machine's fault, not ours
        if not (isinstance(error, InfrastructureFault) or compat.collective_failed(error)):
            record_exit(
                RECORD_REASONS[EXIT_CRASHED], run.state.step
            )  # the job script restarts it, and stops a crash loop
            raise
        say(
            f"prism train: error: infrastructure fault at step {run.state.step}: {str(error).splitlines()[0]}; "
            f"exiting with {EXIT_INFRA} (the job script retries it from the last intact checkpoint; this rank's "
            f"stacks, if it hung, in {run.watch.path.parent if run.watch else cfg.checkpoint_dir})"
        )
        exit_code = EXIT_INFRA
    finally:
        if run.watch is not None:
            run.watch.close()
    return finish(run, exit_code)


def branch_start(cfg: Config) -> restore.Resume | None:
    """A cooldown branch's first start: its main run's tag (pipeline.cooldown, refusing before any folder is
    written); None for a main run or a branch whose own folder already holds a start of it (it resumes)."""
    import torch.distributed as dist

    from pipeline import cooldown

    if not cfg.is_branch:
        return None
    world, tp = dist.get_world_size(), cfg.parallel.tp
    resume = cooldown.start_point(cfg, world // tp if world % tp == 0 else None)
    if resume is not None:
        restore.check_writable(cfg.checkpoint_dir)  # the branch's first write, after every check
    return resume


def setup(cfg: Config, resume: restore.Resume) -> Run:
    """Data, model, engine, initial weights and tracker for one start of ``cfg`` (resume: from where).
    The dataset is checked and verified before the model is built, so a bad one costs nothing."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from pipeline.distributed import topology, topology_line
    from pipeline.profiling import Profiler
    from pipeline.stragglers import RankClock
    from pipeline.tracking.system import other_node_metrics

    manifest = data.checked_manifest(cfg)  # the one compatibility check of this start
    val_manifests = data.checked_val_manifests(cfg, manifest)  # and every validation set's, before step 1
    device = train_device(cfg)
    init_model_parallel(cfg.parallel.tp, cfg.run.seed, device=cfg.train.device)
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    layout = cfg.steps(dp_size)
    total, warmup, grad_accum = layout["total"], layout["warmup"], layout["grad_accum"]
    epochs = check_data_before_start(cfg, manifest, dp_size)  # refuses or verifies: before the model
    p = cfg.parallel  # from here on a hang leaves every rank's stack (and the groups get init_timeout_s)
    watch = HangWatch(diagnostics_dir(cfg), dist.get_rank(), p.init_timeout_s, p.timeout_s, resume.step)
    loader, val_sets, evals = load_data(cfg, manifest, val_manifests, dp_rank, dp_size, device)
    engine, optimizer, state = build_start(cfg, resume, loader, grad_accum, dp_size, device)
    tracker = start_tracker(cfg, state, manifest, epochs, dp_size)
    run = Run(
        cfg,
        engine,
        optimizer,
        loader,
        val_sets,
        tracker,
        StopSignal(),
        state,
        device,
        total,
        warmup,
        grad_accum,
        watch=watch,
    )
    run.saver = Saver(engine, cfg, device)
    run.skipper, run.clock = state.skipper, RankClock(device, faults.slow_rank_seconds(dist.get_rank()))
    run.evals = evals
    run.profiler = Profiler(cfg, dist.get_rank(), device, tracker, engine.module)
    say_kernels(cfg, tracker, device)
    ranks = topology()  # a collective: every rank
    say(f"prism train: {topology_line(ranks)}")
    run_id = [state.run_id]  # rank 0's: the other nodes log their system metrics into the same run
    dist.broadcast_object_list(run_id, src=0)
    run.node_metrics = other_node_metrics(cfg, run_id[0], ranks, dist.get_rank())
    say_start(run, resume, epochs, dp_size)
    if dist.get_rank() == 0:  # its stop reaches every rank through the stop agreement
        run.job_end = slurm_job.JobEnd.of_this_job(cfg.checkpoint.end_margin_s)
        if warning := slurm_job.requeue_warning():
            say(f"prism train: {warning}")
    return run


def load_data(
    cfg: Config,
    manifest: dict[str, Any],
    val_manifests: dict[str, Any],
    dp_rank: int,
    dp_size: int,
    device: str,
) -> tuple[data.ShardLoader, dict[str, np.ndarray], Any]:
    """This DP rank's loader, every validation set's rows and the downstream evals (None without
    train.eval_every): before the model, so a missing eval set or tokenizer costs nothing."""
    loader = data.ShardLoader(
        cfg,
        dp_rank=dp_rank,
        dp_size=dp_size,
        batch_size=cfg.train.micro_batch_size,
        manifest=manifest,
        pin_memory=device == "cuda",
    )
    val_sets = {vs.metric: data.load_val_tokens(cfg, val_manifests[vs.metric], vs) for vs in cfg.validation_sets()}
    return loader, val_sets, downstream_evals(cfg)


def build_start(
    cfg: Config, resume: restore.Resume, loader: Any, grad_accum: int, dp_size: int, device: str
) -> tuple[Any, Any, TrainState]:
    """The model, its initial weights and the engine around it, and the state the loop starts from. Initial
    weights: the checkpoint resumed from (weights, optimizer, loader position, RNG), else a `prism export`
    folder's weights (train.init_from), else the model's own initialisation."""
    from pipeline.model import build_model
    from pipeline.skipping import StepSkipper

    model = build_model(cfg)  # on the GPU already when there is one
    if cfg.train.init_from and not resume.tag:
        from pipeline.export.hf import init_from

        init_from(model, cfg, cfg.train.init_from)
    reshard = resume.tag is not None and restore.reshards(
        resume.saved_tp, resume.saved_dp_size, cfg.parallel.tp, dp_size
    )
    skipper = StepSkipper(cfg.train.skip_window, cfg.train.skip_sigma, device)
    engine, optimizer = build_engine(cfg, model, grad_accum, dp_size, load_universal=reshard, skipper=skipper)
    state = TrainState(loader=loader, skipper=skipper)
    if resume.tag:
        saved_dp = restore.load(engine, cfg, resume.tag, state, resume.source_dir)
        if resume.source_dir is not None:  # a cooldown branch's first start: a new tracking run of its own
            state.run_id = None
        if saved_dp != dp_size:
            say(
                f"prism train: elastic resume: {resume.tag} was saved at data-parallel size {saved_dp}, continuing "
                f"at {dp_size} (same global batch; optimizer partitions re-split, data position mapped)"
            )
        if (resume.saved_tp or cfg.parallel.tp) != cfg.parallel.tp:
            say(
                f"prism train: tensor-parallel resume: {resume.tag} was saved at parallel.tp={resume.saved_tp}, "
                f"continuing at {cfg.parallel.tp} (weights and optimizer state re-split)"
            )
    return engine, optimizer, state


def start_tracker(cfg: Config, state: TrainState, manifest: dict[str, Any], epochs: float, dp_size: int) -> Any:
    """The tracking run, resumed when the checkpoint names one (its id goes into ``state``), with the data
    budget and DP size of this start: constants, so params (not chart metrics); the DP size is part of the
    data order, which `prism compare` pairs seeds by."""
    import torch.distributed as dist

    from pipeline.tracking import make_tracker

    tracker = make_tracker(cfg, dist.get_rank())
    state.run_id = tracker.start(cfg, run_id=state.run_id)
    tracker.log_params(
        {
            "data/epochs": round(epochs, 4),
            "data/tokens_per_epoch": budget.tokens_per_epoch(manifest, dp_size),
            "parallel/dp_size": dp_size,
        }
    )
    return tracker


def say_start(run: Run, resume: restore.Resume, epochs: float, dp_size: int) -> None:
    """The console's start-up lines: damaged checkpoints passed over, what runs where and for how long, and the
    MLflow run's page if there is one."""
    import torch.distributed as dist

    cfg = run.cfg
    for line in resume_notes(resume):  # e.g. a damaged newest checkpoint and the one resumed from instead
        say(line)
    what = f"resumed from {resume.tag}" if resume.tag else "fresh start"
    if resume.source_dir is not None:
        what = f"cooldown branch from {resume.source_dir / resume.tag}: {lr_schedule.describe(cfg)}"
    say(
        f"prism train: {cfg.run_name} | {what} | world {dist.get_world_size()} = TP {cfg.parallel.tp} x DP "
        f"{dp_size} | ZeRO-{cfg.parallel.zero_stage} {cfg.train.precision} on {run.device} | {run.total_steps} "
        f"steps, grad_accum {run.grad_accum}, warmup {run.warmup} | {epochs:.2f} epochs of the data"
    )
    if ui_url := getattr(run.tracker, "ui_url", lambda: None)():
        say(f"prism train: MLflow run {ui_url}")


def say_kernels(cfg: Config, tracker: Any, device: str) -> None:
    """The SDPA kernel each layer gets, asked of torch (pipeline.model.sdpa_backend): MLflow params, one
    start-up line, and one warning line when a GPU layer falls back from flash/cuDNN."""
    from pipeline.model import sdpa_backend

    kernels = sdpa_backend.layer_kernels(cfg, device)
    if not kernels:  # model.attention_backend=megatron: not SDPA
        return
    tracker.log_params(sdpa_backend.kernel_params(cfg, kernels))
    say(f"prism train: {sdpa_backend.kernel_line(cfg, kernels, device)}")
    if warning := sdpa_backend.fallback_warning(cfg, kernels, device):
        say(f"prism train: warning: {warning}")


def loop(run: Run) -> int:
    """Optimizer steps until the token budget is done, a stop signal or a non-finite loss; the exit code."""
    cfg, state, t = run.cfg, run.state, run.cfg.train
    recent: deque[float] = deque(maxlen=20)  # the last losses, for a NaN step's diagnostic
    stop_check = stop_agreement(run.stopper, run.device)
    unread = UnreadSteps(t.max_skips_in_a_row)
    progress = loop_progress(run)
    schedule = lr_schedule.schedule_of(cfg)
    while state.step < run.total_steps:
        faults.before_step(state.step + 1)  # PRISM_FAULT_* in recovery tests; nothing otherwise
        lr = schedule.at(state.step)
        fault = faults.loss_factor(state.step + 1)  # None unless a test sets PRISM_FAULT_LOSS
        result = profiled_step(run, lr, fault)
        state.step += 1
        run.profiler.step_done(state.step)  # the window's last step: traces written, the profiler stopped
        faults.log_batches(state.step, result.batches)  # PRISM_FAULT_BATCH_LOG in tests; nothing otherwise
        run.watch.step_done()  # after the first: short collective timeouts; each: the stack timer re-armed
        state.tokens_seen += t.batch_tokens
        unread.add(state.step, result)
        if run.job_end and not run.stopper.end_reached and (why := run.job_end.due(run.saver.final_save_s())):
            say(f"prism train: {why}: checkpointing at step {state.step} and stopping")
            run.stopper.end_reached = True
        # a profile request rides on the stop agreement's all-reduce: rank 0 reads it at sync steps only
        stop, news = stop_check(run.profiler.poll(step_actions(cfg, state.step, run.total_steps).sync))
        run.profiler.agreed(news, state.step, run.total_steps)
        actions = step_actions(cfg, state.step, run.total_steps, stop)
        if not actions.sync:
            continue  # no host sync on this step: its loss and grad norm are read at the next sync step
        run.saver.poll()  # a save in flight commits once every rank's background write is done
        if cfg.checkpoint.every_minutes and not actions.checkpoint and run.saver.minutes_due():
            actions = step_actions(cfg, state.step, run.total_steps, stop, minutes_due=True)
        bad = unread.read_back(recent)  # the one host sync since the last sync step
        progress.trained(unread.seconds)  # the step line's rate: the same clock as perf/step_time
        for step, skipped in unread.skipped:
            say(
                f"prism train: step {step} skipped (loss {skipped.loss:.4f}, grad norm {skipped.grad_norm:.3f}: "
                f"non-finite or above mean + {t.skip_sigma} std of the last {t.skip_window} steps); weights and "
                "optimizer state unchanged"
            )
        if bad is not None:
            run.saver.close()  # the diagnostics name the last good checkpoint: commit the one in flight first
            report_nonfinite(cfg, *bad, recent)
            return EXIT_NONFINITE
        run.train_loss = result.loss
        do_step_actions(run, actions, result, progress, final=stop or state.step == run.total_steps)
        unread.restart_clock()  # the steps' own time (perf/step_time) leaves this step's extra work out
        if stop and state.step < run.total_steps:  # a signal at the final step: the run is done, nothing to resume
            run.profiler.cut(state.step)  # a trace in progress keeps the steps it has
            say(
                f"prism train: stop signal received; checkpoint at step {state.step} written, exiting with "
                f"{EXIT_STOPPED} (requeue to resume)"
            )
            return EXIT_STOPPED
    return EXIT_FINISHED


def profiled_step(run: Run, lr: float, fault: float | None) -> StepResult:
    """train_step under the run's profiler (a no-op outside a profile window); a CUDA out-of-memory error
    leaves this rank's allocator snapshot (pipeline.profiling) before it ends the run."""
    import torch

    from pipeline.profiling import dump_on_oom

    step = run.state.step + 1
    try:
        with run.profiler.step(step):
            return train_step(
                run.engine,
                run.optimizer,
                run.loader,
                lr,
                run.grad_accum,
                run.device,
                run.skipper,
                run.cfg.train.z_loss,
                fault,
                run.clock,
            )
    except torch.cuda.OutOfMemoryError:
        dump_on_oom(run.cfg.run_dir, step, run.profiler.rank)
        raise


def loop_progress(run: Run) -> Progress:
    """The console's pace and ETA for the steps left, knowing which of them validate, eval and checkpoint
    (their time is set aside, not counted as training)."""
    cfg, t, start = run.cfg, run.cfg.train, run.state.step
    planned = {step: step_actions(cfg, step, run.total_steps) for step in range(start + 1, run.total_steps + 1)}
    return Progress(
        run.total_steps,
        start,
        t.batch_tokens,
        validation_steps=[s for s, a in planned.items() if a.validate],
        checkpoint_steps=[s for s, a in planned.items() if a.checkpoint],
        validation_tokens=sum(rows.shape[0] for rows in run.val_sets.values()) * cfg.model.seq_len,
        eval_steps=[s for s, a in planned.items() if a.eval],
        eval_tokens=eval_tokens(t.eval_tasks, t.eval_limit),
    )


def do_step_actions(run: Run, actions: StepActions, result: StepResult, progress: Progress, final: bool) -> None:
    """A sync step's extra work, in this order: validation, the log line, downstream evals, the checkpoint
    (``final``: the last step's or a stop signal's)."""
    from pipeline.stragglers import gather_rank_times, straggler_metrics

    cfg, state, t = run.cfg, run.state, run.cfg.train
    val_losses = {}
    if actions.validate:
        with progress.aside("validation"):  # every set: its time stays out of tokens/s
            scored = {m: evaluate(run.engine, rows, t.micro_batch_size, run.device) for m, rows in run.val_sets.items()}
            val_losses = {m: loss for m, (loss, _) in scored.items()}
        run.val_loss = val_losses[val_loss_metric(None)]  # the run's own val split: the summary's val loss
        save_val_items(run, {m: rows for m, (_, rows) in scored.items()})
    if actions.log:
        stragglers = straggler_metrics(gather_rank_times(run.clock, run.device))  # every rank: a collective
        pace = progress.pace(state.step)
        log_step(cfg, run.tracker, state, run.total_steps, result, val_losses, run.device, pace, stragglers)
    if actions.eval:  # before the checkpoint: a resume from it never skips this step's eval
        with progress.aside("eval"):
            downstream_eval(run)
    if actions.checkpoint:
        with progress.aside("checkpoint"):  # the time the step is blocked: staging, or the whole write
            run.saver.save(state, final=final)


def downstream_evals(cfg: Config) -> Any:
    """The evals during training (pipeline.eval.in_run), checked before step 1; None without train.eval_every."""
    if not cfg.train.eval_every:
        return None
    from pipeline.eval.in_run import DownstreamEval

    return DownstreamEval(cfg)


def downstream_eval(run: Run) -> None:
    """This step's zero-shot scores, on every rank: to the tracker at the step, one console line."""
    import torch.distributed as dist

    from pipeline.eval import items as eval_items
    from pipeline.eval.in_run import eval_line
    from pipeline.eval.zeroshot import score_metrics

    t0 = time.perf_counter()
    scores, items = run.evals(run.engine)
    if scores:  # where lm-eval returned them (global rank 0 among them)
        run.tracker.log_metrics(score_metrics(scores), run.state.step)
        say(eval_line(run.state.step, scores, time.perf_counter() - t0))
        if dist.get_rank() == 0:  # one writer of the per-item file (pipeline.eval.items), as `prism eval` writes it
            data = eval_items.write_items(run.cfg.run_dir, run.state.step, items)[1]
            run.tracker.log_artifact_text(data, eval_items.items_artifact(run.state.step))


def save_val_items(run: Run, per_row: dict[str, np.ndarray]) -> None:
    """Rank 0 writes a validation's per-sequence losses of every set (pipeline.eval.items) and logs them as
    artifacts: a few KB per set (4 bytes a row). The tracker journals them, so an outage loses nothing."""
    import torch.distributed as dist

    from pipeline.eval import items as eval_items

    if dist.get_rank() != 0:
        return
    for vs in run.cfg.validation_sets():
        data = eval_items.write_val(run.cfg.run_dir, vs.name, run.state.step, per_row[vs.metric])[1]
        run.tracker.log_artifact_text(data, eval_items.val_artifact(vs.name, run.state.step))


def finish(run: Run, exit_code: int) -> dict[str, Any]:
    """The exit record, the signal handlers and loader back, the tracking run closed; the summary."""
    reason = RECORD_REASONS[exit_code]
    # before restoring the signal handlers: a late stop signal must not kill us first
    record_exit(reason, run.state.step)
    run.stopper.restore()
    run.loader.close()
    if run.node_metrics is not None:
        run.node_metrics.finish()
    run.tracker.finish(
        {EXIT_FINISHED: "FINISHED", EXIT_STOPPED: "KILLED", EXIT_NONFINITE: "FAILED", EXIT_INFRA: "FAILED"}[exit_code]
    )
    return {
        "steps": run.state.step,
        "total_steps": run.total_steps,
        "tokens_seen": run.state.tokens_seen,
        "train_loss": run.train_loss,
        "val_loss": run.val_loss,
        "run_id": run.state.run_id,
        "exit_reason": reason,
        "exit_code": exit_code,
    }


def already_finished(cfg: Config, resume: restore.Resume) -> dict[str, Any]:
    """A run whose last step is already checkpointed: nothing is trained."""
    total = cfg.steps(1)["total"]
    for line in resume_notes(resume):
        say(line)
    say(
        f"prism train: {cfg.run_name} already finished: {cfg.checkpoint_dir / resume.tag} is step {resume.step} "
        f"of {total}; nothing to do (to train again, use another run.output_dir)"
    )
    return {
        "steps": resume.step,
        "total_steps": total,
        "tokens_seen": resume.step * cfg.train.batch_tokens,
        "train_loss": float("nan"),
        "val_loss": None,
        "run_id": None,
        "exit_reason": "already_finished",
        "exit_code": EXIT_FINISHED,
    }


def resume_notes(resume: restore.Resume) -> list[str]:
    """The console's warning when damaged checkpoints were passed over."""
    if not resume.damaged:
        return []
    more = len(resume.damaged) - 1
    return [
        f"prism train: warning: {resume.damaged[0]}; resuming from {resume.tag}, the newest intact checkpoint"
        + (f" ({more} more damaged)" if more else "")
    ]


def record_exit(reason: str, step: int) -> None:
    """The exit record for launchers/train_job.sh, from global rank 0 only."""
    import torch.distributed as dist

    from pipeline.distributed import write_exit_record

    if dist.get_rank() == 0:
        write_exit_record(reason, step)


def say(text: str) -> None:
    """One console line, from global rank 0 only."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        print(text, flush=True)

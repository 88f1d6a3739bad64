"""Everything before the first step: where a run starts (a cooldown branch or its own checkpoints), the Run it
trains (data, model, engine, initial weights, the tracker), the start lines, and the answer for a run that
is already finished."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline import budget, data, faults, lr_schedule, slurm_job
from pipeline.checkpoint import restore
from pipeline.checkpoint.restore import TrainState
from pipeline.checkpoint.writer import Saver
from pipeline.config import Config
from pipeline.distributed import (
    HangWatch,
    StopSignal,
    diagnostics_dir,
    init_model_parallel,
    train_device,
)
from pipeline.exit_codes import (
    EXIT_FINISHED,
)
from pipeline.train.diagnostics import check_data_before_start, say
from pipeline.train.engine import build_engine

# --- schedule and optimizer -----------------------------------------------------------------------------
# The LR is a function of the step alone; its formulas live in pipeline.lr_schedule (plan draws the same curve).


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


def downstream_evals(cfg: Config) -> Any:
    """The evals during training (pipeline.eval.in_run), checked before step 1; None without train.eval_every."""
    if not cfg.train.eval_every:
        return None
    from pipeline.eval.in_run import DownstreamEval

    return DownstreamEval(cfg)

"""The training loop: DeepSpeed ZeRO engine around a Megatron-core GPTModel, nanoGPT-style.

    prism train CONFIG [overrides]            # one process
    torchrun --nproc-per-node N -m pipeline.cli train CONFIG ...   # N processes (TP x DP)

Read it bottom up: `train` is the loop (resume, validation, checkpoints, stop and NaN
handling), `train_step` one optimizer step, `log_step` one log line. Process groups and collectives are in
pipeline.distributed, what a checkpoint holds in pipeline.checkpoint.
"""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline import checkpoint, data
from pipeline.atomic import write_atomic
from pipeline.checkpoint import TrainState
from pipeline.config import Config
from pipeline.distributed import StopSignal, deepspeed_device_args, dp_mean, dp_sum, init_model_parallel, train_device

EXIT_FINISHED, EXIT_BAD_INPUT, EXIT_STOPPED, EXIT_NONFINITE = 0, 2, 3, 4


# --- schedule and optimizer -----------------------------------------------------------------------------
def lr_at(step: int, total: int, warmup: int, lr: float, min_lr: float) -> float:
    """LR for optimizer step ``step`` (0-based): linear warmup to ``lr``, then cosine down to ``min_lr``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


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
    import torch

    t = cfg.train
    # A client torch AdamW: DeepSpeed's own "AdamW" would JIT-build FusedAdam (~80 s) and differs per device.
    return torch.optim.AdamW(
        param_groups(model, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, foreach=False
    )


# --- the engine ----------------------------------------------------------------------------------------
def deepspeed_config(cfg: Config, grad_accum: int, dp_size: int) -> dict[str, Any]:
    t = cfg.train
    return {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        "train_batch_size": t.micro_batch_size * grad_accum * dp_size,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": {"stage": cfg.parallel.zero_stage},
        "bf16": {"enabled": t.precision == "bf16"},
        # bf16 like the paper's codebase: fp32 master weights and micro-batch gradients summed in fp32, so the
        # result does not depend on how many micro-batches (GPUs) make up a step
        **({"data_types": {"grad_accum_dtype": "fp32"}} if t.precision == "bf16" else {}),
        "zero_allow_untested_optimizer": True,  # the client torch AdamW
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def build_engine(cfg: Config, model: Any, grad_accum: int, dp_size: int) -> tuple[Any, Any]:
    from pipeline import compat

    deepspeed = compat.import_deepspeed()
    optimizer = make_optimizer(cfg, model)
    engine, *_ = deepspeed.initialize(
        args=deepspeed_device_args(),  # this worker's GPU, not LOCAL_RANK (one GPU per Slurm task)
        model=model,
        optimizer=optimizer,
        mpu=compat.MegatronMpu(),
        config=deepspeed_config(cfg, grad_accum, dp_size),
    )
    return engine, optimizer


# --- measurements -------------------------------------------------------------------------------------
def peak_flops(cfg: Config, device: str) -> float | None:
    """Per-device peak for MFU: train.peak_flops, else an exact device-name match (pipeline.hardware)."""
    from pipeline.hardware import device_peak_flops

    return device_peak_flops(cfg.train.peak_flops, device)


def mfu_causal_attention(cfg: Config, tokens_per_sec: float, peak: float | None, gpus: int) -> float | None:
    """MFU with attention's matmuls halved for the causal mask (Megatron's / llm.c's convention); `mfu`
    counts them in full (pipeline.hardware explains both)."""
    from pipeline.hardware import causal_attention_discount
    from pipeline.model import flops_per_token

    if not peak:
        return None
    m = cfg.model
    flops = causal_attention_discount(flops_per_token(cfg), cfg.heads_per_layer, m.d_model, m.seq_len)
    return flops * tokens_per_sec / (peak * gpus)


def memory_gb(device: str) -> float:
    if device == "cuda":
        import torch

        return torch.cuda.max_memory_allocated() / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux: peak RSS


def evaluate(engine: Any, val_rows: np.ndarray, micro: int, device: str) -> float:
    """Mean loss over the fixed val rows; rows are dealt to DP ranks round-robin, TP peers share them."""
    import torch
    from megatron.core import parallel_state

    from pipeline.model import lm_loss

    rank, size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    mine = val_rows[rank::size]
    total = torch.zeros(2, dtype=torch.float64, device=device)
    engine.eval()
    with torch.no_grad():
        for i in range(0, len(mine), micro):
            tokens = torch.from_numpy(mine[i : i + micro].astype(np.int64)).to(device)
            total[0] += lm_loss(engine, tokens).double() * len(tokens)
            total[1] += len(tokens)
    engine.train()
    dp_sum(total)
    return float(total[0] / total[1])


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

    @property
    def finite(self) -> bool:
        return math.isfinite(self.loss) and math.isfinite(self.grad_norm)


def train_step(engine: Any, optimizer: Any, loader: Any, lr: float, grad_accum: int, device: str) -> StepResult:
    """One optimizer step: ``grad_accum`` micro-batches forward and backward, DeepSpeed's clipped update."""
    import torch

    from pipeline.model import lm_loss

    t0 = time.perf_counter()
    for group in optimizer.param_groups:
        group["lr"] = lr
    position_before = loader.state_dict()
    batches, micro_losses = [], []
    for _ in range(grad_accum):
        batch = loader.next_batch()
        batches.append(batch)
        loss = lm_loss(engine, torch.from_numpy(batch).to(device))
        engine.backward(loss)
        engine.step()  # DeepSpeed applies the update at the accumulation boundary only
        micro_losses.append(loss.detach())
    mean_loss = dp_mean(torch.stack(micro_losses).float().mean(), device)
    grad_norm = float(engine.get_global_grad_norm() or 0.0)
    return StepResult(mean_loss, grad_norm, lr, time.perf_counter() - t0, micro_losses, batches, position_before)


def log_step(
    cfg: Config,
    tracker: Any,
    state: TrainState,
    total_steps: int,
    result: StepResult,
    val_loss: float | None,
    device: str,
    progress: tuple[int, float, float] | None = None,
) -> None:
    """Metrics to the tracker and, on rank 0, one console line.

    ``progress`` = (steps since the last line, their wall seconds, seconds since this process started
    training): the line's tok/s averages those steps (validation included) and ETA extrapolates them."""
    import torch.distributed as dist

    from pipeline.model import flops_per_token

    tok_s = cfg.train.batch_tokens / result.seconds
    peak = peak_flops(cfg, device)
    mfu = flops_per_token(cfg) * tok_s / (peak * dist.get_world_size()) if peak else None
    mfu_causal = mfu_causal_attention(cfg, tok_s, peak, dist.get_world_size())
    metrics = {
        "train/loss": result.loss,
        "lr": result.lr,
        "grad_norm": result.grad_norm,
        "tokens_per_sec": tok_s,
        "step_time": result.seconds,
        "tokens_seen": state.tokens_seen,
        "memory_gb": memory_gb(device),
    }
    if val_loss is not None:
        metrics["val/loss"] = val_loss
    if mfu is not None:
        metrics["mfu"] = mfu
        metrics["mfu_causal"] = mfu_causal
    tracker.log_metrics(metrics, state.step)
    if dist.get_rank() == 0:
        timing = ""
        if progress is not None and progress[0] > 0 and progress[1] > 0:
            from pipeline.console import duration

            steps, seconds, elapsed = progress
            tok_s = steps * cfg.train.batch_tokens / seconds
            eta = (total_steps - state.step) * seconds / steps
            timing = f" | {duration(elapsed)} elapsed, ETA {duration(eta)}"
        print(
            f"step {state.step:>6}/{total_steps} | tokens {state.tokens_seen:,} | loss {result.loss:.4f}"
            + (f" | val {val_loss:.4f}" if val_loss is not None else "")
            + f" | lr {result.lr:.3e} | grad_norm {result.grad_norm:.3f} | {tok_s:,.0f} tok/s"
            + timing
            + (f" | mfu {100 * mfu:.1f}%" if mfu is not None else "")
            + f" | mem {metrics['memory_gb']:.2f} GB",
            flush=True,
        )


def report_nonfinite(cfg: Config, step: int, result: StepResult, recent: deque[float]) -> None:
    """Diagnostic for a NaN/inf step: numbers as JSON, this rank's batches of the step as .npz; one error line."""
    import torch.distributed as dist

    info = {
        "step": step,
        "train_loss": result.loss,
        "grad_norm": result.grad_norm,
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
        print(
            f"prism train: error: non-finite loss {result.loss} / grad norm {result.grad_norm} at step {step}; "
            f"diagnostics in {path}; last good checkpoint {info['last_good_checkpoint']} is kept "
            f"(lower train.lr or check the data, then resume)",
            file=sys.stderr,
            flush=True,
        )


def train(cfg: Config) -> dict[str, Any]:
    """Train (or resume) ``cfg`` inside the current process group; returns a summary with ``exit_code``."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from pipeline.model import build_model
    from pipeline.model.gpt import check_spec
    from pipeline.tracking import make_tracker

    # Refuse bad input before anything expensive: a changed config on resume, a mismatched dataset.
    resume_tag = checkpoint.check_resume(cfg)
    check_spec(cfg)  # model.spec=transformer_engine where TE cannot run: one line, before any process group
    manifest = data.read_manifest(cfg.data.dataset_dir)
    data.check_compatible(manifest, cfg)
    device = train_device(cfg)

    init_model_parallel(cfg.parallel.tp, cfg.run.seed, device=cfg.train.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    plan = cfg.steps(dp_size)
    total_steps, warmup, grad_accum = plan["total"], plan["warmup"], plan["grad_accum"]
    micro, t = cfg.train.micro_batch_size, cfg.train
    master = rank == 0

    loader = data.ShardLoader(cfg, dp_rank=dp_rank, dp_size=dp_size, batch_size=micro, manifest=manifest)
    val_rows = data.load_val_tokens(cfg, manifest)
    model = build_model(cfg)  # on the GPU already when there is one
    engine, optimizer = build_engine(cfg, model, grad_accum, dp_size)

    state = TrainState(loader=loader)
    if resume_tag:
        checkpoint.load(engine, cfg, resume_tag, state)
    tracker = make_tracker(cfg, rank)
    state.run_id = tracker.start(cfg, run_id=state.run_id)
    stopper = StopSignal()
    if master:
        what = f"resumed from {resume_tag}" if resume_tag else "fresh start"
        print(
            f"prism train: {cfg.run_name} | {what} | world {world} = TP {cfg.parallel.tp} x DP {dp_size} | "
            f"ZeRO-{cfg.parallel.zero_stage} {t.precision} on {device} | {total_steps} steps, grad_accum "
            f"{grad_accum}, warmup {warmup}",
            flush=True,
        )
        ui_url = getattr(tracker, "ui_url", lambda: None)()
        if ui_url:
            print(f"prism train: MLflow run {ui_url}", flush=True)

    exit_code, train_loss, last_val = EXIT_FINISHED, float("nan"), None
    recent: deque[float] = deque(maxlen=20)
    started = last_line = time.perf_counter()  # console progress: wall time of the steps since the last line
    last_line_step = state.step
    while state.step < total_steps:
        lr = lr_at(state.step, total_steps, warmup, t.lr, t.min_lr)
        result = train_step(engine, optimizer, loader, lr, grad_accum, device)
        state.step += 1
        state.tokens_seen += t.batch_tokens
        train_loss = result.loss
        if not result.finite:
            report_nonfinite(cfg, state.step, result, recent)
            exit_code = EXIT_NONFINITE
            break
        recent.append(train_loss)

        step = state.step
        val_loss = None
        if step % t.val_every == 0 or step == total_steps:
            val_loss = last_val = evaluate(engine, val_rows, micro, device)
        if step % t.log_every == 0 or step == total_steps or val_loss is not None or step == 1:
            now = time.perf_counter()
            progress = (state.step - last_line_step, now - last_line, now - started)
            log_step(cfg, tracker, state, total_steps, result, val_loss, device, progress)
            last_line, last_line_step = now, state.step

        stop = stopper.agreed(device)
        if step % cfg.checkpoint.every_steps == 0 or step == total_steps or stop:
            tag = checkpoint.save(engine, cfg, state)
            if master:
                print(f"prism train: checkpoint {cfg.checkpoint_dir / tag}", flush=True)
        if stop:
            if master:
                print(
                    f"prism train: stop signal received; checkpoint at step {step} written, exiting with "
                    f"{EXIT_STOPPED} (requeue to resume)",
                    flush=True,
                )
            exit_code = EXIT_STOPPED
            break

    stopper.restore()
    loader.close()
    status = {EXIT_FINISHED: "FINISHED", EXIT_STOPPED: "KILLED", EXIT_NONFINITE: "FAILED"}[exit_code]
    tracker.finish(status)
    reason = {EXIT_FINISHED: "finished", EXIT_STOPPED: "signal", EXIT_NONFINITE: "nonfinite"}[exit_code]
    return {
        "steps": state.step,
        "total_steps": total_steps,
        "tokens_seen": state.tokens_seen,
        "train_loss": train_loss,
        "val_loss": last_val,
        "run_id": state.run_id,
        "exit_reason": reason,
        "exit_code": exit_code,
    }

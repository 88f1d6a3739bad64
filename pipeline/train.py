"""The training loop: DeepSpeed ZeRO engine around a Megatron-core GPTModel, nanoGPT-style.

    prism train CONFIG [overrides]            # one process
    torchrun --nproc-per-node N -m pipeline.cli train CONFIG ...   # N processes (TP x DP)

The loop below reads top to bottom like nanoGPT's; the parallel plumbing (process groups, the engine, the
collectives that keep ranks in step) lives in the small named helpers above it.
"""

from __future__ import annotations

import json
import math
import os
import resource
import signal
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

from pipeline import checkpoint, data
from pipeline.atomic import write_atomic
from pipeline.config import Config, ConfigError
from pipeline.distributed import DeviceError, dp_mean, resolve_device

EXIT_FINISHED, EXIT_BAD_INPUT, EXIT_STOPPED, EXIT_NONFINITE = 0, 2, 3, 4
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)

# Dense bf16 tensor-core peak per device (FLOP/s), matched by substring of torch.cuda.get_device_name().
PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 125e12,
    "L4": 121e12,
    "V100": 125e12,
}


# --- schedule and optimizer -----------------------------------------------------------------------------
def lr_at(step: int, total: int, warmup: int, lr: float, min_lr: float) -> float:
    """LR for optimizer step ``step`` (0-based): linear warmup to ``lr``, then cosine down to ``min_lr``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


def param_groups(model: Any, weight_decay: float) -> list[dict[str, Any]]:
    """nanoGPT's split: matrices decay; norms, biases and embeddings don't."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 or "embedding" in name else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def make_optimizer(cfg: Config, model: Any) -> Any:
    import torch

    t = cfg.train
    # A client torch AdamW: DeepSpeed's own "AdamW" would JIT-build FusedAdam (~80 s) and differs per device.
    return torch.optim.AdamW(
        param_groups(model, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, foreach=False
    )


# --- parallel plumbing ----------------------------------------------------------------------------------
def deepspeed_config(cfg: Config, grad_accum: int, dp_size: int) -> dict[str, Any]:
    t = cfg.train
    return {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        "train_batch_size": t.micro_batch_size * grad_accum * dp_size,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": {"stage": cfg.parallel.zero_stage},
        "bf16": {"enabled": t.precision == "bf16"},
        "zero_allow_untested_optimizer": True,  # the client torch AdamW
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def build_engine(cfg: Config, model: Any, grad_accum: int, dp_size: int) -> tuple[Any, Any]:
    from pipeline import compat

    deepspeed = compat.import_deepspeed()
    optimizer = make_optimizer(cfg, model)
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=optimizer, mpu=compat.MegatronMpu(), config=deepspeed_config(cfg, grad_accum, dp_size)
    )
    return engine, optimizer


class StopSignal:
    """SIGTERM/SIGUSR1/SIGUSR2 set a flag; ranks agree at each step boundary (all-reduce MAX) to stop together."""

    def __init__(self) -> None:
        self.received: int | None = None
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = signum

    def agreed(self, device: str) -> bool:
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1.0 if self.received else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def restore(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_DFL)


def peak_flops(cfg: Config, device: str) -> float | None:
    if cfg.train.peak_flops:
        return cfg.train.peak_flops
    if device == "cuda":
        import torch

        name = torch.cuda.get_device_name()
        return next((v for k, v in PEAK_FLOPS.items() if k in name), None)
    return None


def memory_gb(device: str) -> float:
    if device == "cuda":
        import torch

        return torch.cuda.max_memory_allocated() / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux: peak RSS


def evaluate(engine: Any, val_rows: np.ndarray, micro: int, device: str) -> float:
    """Mean loss over the fixed val rows; rows are dealt to DP ranks round-robin, TP peers share them."""
    import torch
    import torch.distributed as dist
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
    dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
    return float(total[0] / total[1])


def dump_nonfinite(cfg: Config, step: int, info: dict[str, Any], batches: list[np.ndarray]) -> Path:
    """Diagnostic for a NaN/inf step: numbers as JSON, this rank's batches of the step as .npz."""
    import torch.distributed as dist

    rank = dist.get_rank()
    path = cfg.checkpoint_dir / f"nonfinite-step-{step:07d}-rank{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path.with_suffix(".npz"), *batches)
    write_atomic(path, json.dumps(info, indent=1, default=str))
    return path


# --- the loop ---------------------------------------------------------------------------------------
def train(cfg: Config) -> dict[str, Any]:
    """Train (or resume) ``cfg`` inside the current process group; returns a summary with ``exit_code``."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from pipeline import compat
    from pipeline.model import build_model, flops_per_token, lm_loss
    from pipeline.tracking import make_tracker

    # Refuse bad input before anything expensive: a changed config on resume, a mismatched dataset.
    resume_tag = checkpoint.check_resume(cfg)
    manifest = data.read_manifest(cfg.data.dataset_dir)
    data.check_compatible(manifest, cfg)
    try:
        device = resolve_device(cfg.train.device)
    except DeviceError as e:
        raise ConfigError(f"{cfg.source}: train.device: {e}") from None

    compat.init_model_parallel(cfg.parallel.tp, cfg.run.seed)
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

    step, tokens_seen, run_id = 0, 0, None
    if resume_tag:
        client = checkpoint.load(engine, cfg, resume_tag)
        state = client["prism"]
        step, tokens_seen, run_id = state["step"], client["tokens_seen"], client.get("run_id")
        loader.load_state_dict(state["rank"]["loader"])
    tracker = make_tracker(cfg, rank)
    run_id = tracker.start(cfg, run_id=run_id)
    flops_tok, peak = flops_per_token(cfg), peak_flops(cfg, device)
    stopper = StopSignal()
    if master:
        what = f"resumed from {resume_tag}" if resume_tag else "fresh start"
        print(
            f"prism train: {cfg.run_name} | {what} | world {world} = TP {cfg.parallel.tp} x DP {dp_size} | "
            f"ZeRO-{cfg.parallel.zero_stage} {t.precision} on {device} | {total_steps} steps, grad_accum "
            f"{grad_accum}, warmup {warmup}",
            flush=True,
        )

    def save(at: int) -> str:
        client_state = {"tokens_seen": tokens_seen, "run_id": run_id}
        return checkpoint.save(engine, cfg, at, client_state, per_rank={"loader": loader.state_dict()})

    exit_code, train_loss, last_val = EXIT_FINISHED, float("nan"), None
    recent: deque[float] = deque(maxlen=20)
    while step < total_steps:
        t0 = time.perf_counter()
        lr = lr_at(step, total_steps, warmup, t.lr, t.min_lr)
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
        train_loss = dp_mean(torch.stack(micro_losses).float().mean(), device)
        grad_norm = float(engine.get_global_grad_norm() or 0.0)
        step += 1
        tokens_seen += t.batch_tokens
        step_time = time.perf_counter() - t0

        if not (math.isfinite(train_loss) and math.isfinite(grad_norm)):
            info = {
                "step": step,
                "train_loss": train_loss,
                "grad_norm": grad_norm,
                "lr": lr,
                "micro_losses": [float(x) for x in micro_losses],
                "recent_losses": list(recent),
                "loader_position_before_step": position_before,
                "last_good_checkpoint": checkpoint.latest_tag(cfg.checkpoint_dir),
            }
            path = dump_nonfinite(cfg, step, info, batches)
            if master:
                print(
                    f"prism train: error: non-finite loss {train_loss} / grad norm {grad_norm} at step {step}; "
                    f"diagnostics in {path}; last good checkpoint {info['last_good_checkpoint']} is kept "
                    f"(lower train.lr or check the data, then resume)",
                    file=sys.stderr,
                    flush=True,
                )
            exit_code = EXIT_NONFINITE
            break
        recent.append(train_loss)

        val_loss = None
        if step % t.val_every == 0 or step == total_steps:
            val_loss = last_val = evaluate(engine, val_rows, micro, device)
        if step % t.log_every == 0 or step == total_steps or val_loss is not None or step == 1:
            tok_s = t.batch_tokens / step_time
            mfu = flops_tok * tok_s / (peak * world) if peak else None
            metrics = {
                "train/loss": train_loss,
                "lr": lr,
                "grad_norm": grad_norm,
                "tokens_per_sec": tok_s,
                "step_time": step_time,
                "tokens_seen": tokens_seen,
                "memory_gb": memory_gb(device),
            }
            if val_loss is not None:
                metrics["val/loss"] = val_loss
            if mfu is not None:
                metrics["mfu"] = mfu
            tracker.log_metrics(metrics, step)
            if master:
                print(
                    f"step {step:>6}/{total_steps} | tokens {tokens_seen:,} | loss {train_loss:.4f}"
                    + (f" | val {val_loss:.4f}" if val_loss is not None else "")
                    + f" | lr {lr:.3e} | grad_norm {grad_norm:.3f} | {tok_s:,.0f} tok/s"
                    + (f" | mfu {100 * mfu:.1f}%" if mfu is not None else "")
                    + f" | mem {metrics['memory_gb']:.2f} GB",
                    flush=True,
                )

        stop = stopper.agreed(device)
        if step % cfg.checkpoint.every_steps == 0 or step == total_steps or stop:
            tag = save(step)
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
        "steps": step,
        "total_steps": total_steps,
        "tokens_seen": tokens_seen,
        "train_loss": train_loss,
        "val_loss": last_val,
        "run_id": run_id,
        "exit_reason": reason,
        "exit_code": exit_code,
    }


def setup_threads() -> None:
    """Several ranks on one CPU host must not each spawn a thread per core."""
    if "LOCAL_WORLD_SIZE" in os.environ and "OMP_NUM_THREADS" not in os.environ:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"])))

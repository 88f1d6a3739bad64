"""The engine the loop drives: AdamW and its parameter groups, the DeepSpeed config, the engine built around the
model, one optimizer step (`train_step`) and a validation pass (`evaluate`)."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.config import Config
from pipeline.distributed import (
    deepspeed_device_args,
    dp_sum,
)

# --- schedule and optimizer -----------------------------------------------------------------------------
# The LR is a function of the step alone; its formulas live in pipeline.lr_schedule (plan draws the same curve).


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
    # A client torch AdamW: DeepSpeed's own "AdamW" would JIT-build FusedAdam at start and differs per device.
    # Under ZeRO-1/2 DeepSpeed swaps each group's params for one flat fp32 partition and steps THIS optimizer
    # on it (stage_1_and_2.py: optimizer.param_groups[i]["params"] = [flat fp32 partition]), so a fused
    # AdamW runs one kernel over each flat group. Fused on CPU too: it is the kernel that can skip a step on
    # the device (pipeline.skipping), and much faster than the per-tensor loop there (the two differ by an ulp).
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

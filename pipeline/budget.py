"""A run's budget, before it spends an allocation: layout, steps, tokens, epochs, memory, FLOPs, time.

What `prism plan` prints (the verb keeps its name; this module is named for what it computes). Pure
arithmetic on the Config (and the dataset's manifest when it is prepared); imports no torch, so
`prism plan` answers in well under a second. The trainer uses the same functions for the layout
(Config.steps) and for the epoch check, and parameters and FLOPs per token are pipeline.model_size's (the
model's and the MFU's), so the budget and the run cannot disagree.

Memory per GPU is an estimate (ZeRO paper accounting, Megatron's activation formula), not a measurement:
- parameters: bytes of the module's dtype (bf16: 2, fp32: 4); ZeRO-3 partitions them over DP;
- gradients: fp32 accumulation (4 bytes) in both precisions; ZeRO-2/3 partition them over DP;
- optimizer states: AdamW m and v in fp32 (8 bytes) plus, under bf16, the fp32 master weights (4 bytes);
  ZeRO-1/2/3 partition them over DP;
- activations of one micro-batch b (no recomputation), per layer s*b*d*(10 + 24/TP) bytes (Korthikanti et
  al. 2022, bf16), plus 5*h_l*s^2*b/TP bytes for the stored attention scores when the attention backend is
  "megatron" (SDPA/FlashAttention keeps none), plus the fp32 logits and their gradient (8*s*b*V/TP).
Everything is divided by TP: Megatron shards every layer's weights and the vocabulary over TP ranks.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline import lr_schedule
from pipeline.cadence import is_milestone
from pipeline.config import Config, ConfigError
from pipeline.console import duration
from pipeline.dataset import MANIFEST, DataError
from pipeline.model_size import flops_per_token, padded_vocab, parameter_count

GIB = 2**30
# Known sizes of inputs the presets name, in GPT-2 tokens (FineWeb's sample cards), when not prepared yet.
KNOWN_INPUT_TOKENS = {
    "hf://datasets/HuggingFaceFW/fineweb/sample/10BT": 10_000_000_000,
    "hf://datasets/HuggingFaceFW/fineweb/sample/100BT": 100_000_000_000,
    "hf://datasets/HuggingFaceFW/fineweb/sample/350BT": 350_000_000_000,
}
VERIFY_AUTO_BYTES = GIB  # data.verify_on_start=auto hashes datasets up to this size (~1-3 s at sha256 speed)


# --- layout: the trainer's arithmetic --------------------------------------------------------------------
def data_parallel_size(cfg: Config, world_size: int) -> int:
    """DP = world / TP, as Megatron's parallel_state builds it (every rank is in one TP group)."""
    tp = cfg.parallel.tp
    if world_size < 1:
        raise ConfigError(f"world size {world_size} must be >= 1 (--nodes x --gpus-per-node)")
    if world_size % tp:
        raise ConfigError(
            f"{cfg.source}: world size {world_size} is not divisible by parallel.tp={tp}; use a multiple of {tp} GPUs "
            f"or another parallel.tp"
        )
    return world_size // tp


# --- the dataset: tokens per epoch, the repeat rule, verify-on-start ---------------------------------------
def read_manifest_if_prepared(cfg: Config) -> dict[str, Any] | None:
    """The manifest (schema-checked) when data.dataset_dir holds one, else None."""
    from pipeline.dataset import read_manifest

    if not (Path(cfg.data.dataset_dir) / MANIFEST).is_file():
        return None
    return read_manifest(cfg.data.dataset_dir)


def tokens_per_epoch(manifest: dict[str, Any], dp_size: int) -> int:
    """Train tokens one epoch of the loader yields at this DP size: it deals whole shards to the DP ranks and
    drops the remainder (pipeline.data.ShardLoader), and each row trains seq_len tokens."""
    train = manifest["splits"]["train"]
    shards = len(train["shards"]) // dp_size * dp_size
    return shards * train["samples_per_shard"] * manifest["sequences_per_sample"] * manifest["seq_len"]


def trained_tokens(cfg: Config) -> int:
    """What the loop trains: whole optimizer steps of train.batch_tokens (Config.steps; a cooldown branch: up to
    the end of its decay, counted from its main run's first step, as the data order is)."""
    return cfg.steps(1)["total"] * cfg.train.batch_tokens


def epochs(cfg: Config, manifest: dict[str, Any], dp_size: int) -> float:
    per_epoch = tokens_per_epoch(manifest, dp_size)
    return math.inf if per_epoch == 0 else trained_tokens(cfg) / per_epoch


def check_epochs(cfg: Config, manifest: dict[str, Any], dp_size: int) -> float:
    """Epochs of the train split the token budget needs; refuses more than one unless data.allow_repeat."""
    n = epochs(cfg, manifest, dp_size)
    if n > 1 and not cfg.data.allow_repeat:
        where = Path(cfg.data.dataset_dir) / MANIFEST
        raise DataError(
            f"{where}: train.train_tokens={cfg.train.train_tokens:,} is {n:.3f} epochs of the prepared train split "
            f"({tokens_per_epoch(manifest, dp_size):,} tokens at DP={dp_size}); prepare a larger data.input, lower "
            f"train.train_tokens, or set data.allow_repeat=true to repeat the data"
        )
    return n


def dataset_bytes(cfg: Config, manifest: dict[str, Any]) -> int:
    root = Path(cfg.data.dataset_dir)
    return sum(
        (root / s["path"]).stat().st_size if (root / s["path"]).is_file() else 0
        for split in manifest["splits"].values()
        for s in split["shards"]
    )


def should_verify_on_start(cfg: Config, manifest: dict[str, Any]) -> bool:
    """data.verify_on_start: true/false as said; "auto" = when every shard together is <= 1 GiB."""
    choice = cfg.data.verify_on_start
    if choice == "auto":
        return dataset_bytes(cfg, manifest) <= VERIFY_AUTO_BYTES
    return bool(choice)


# --- memory --------------------------------------------------------------------------------------------
def memory_per_gpu(cfg: Config, dp_size: int) -> dict[str, float]:
    """Bytes per GPU by kind (see the module docstring for the accounting)."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    params = parameter_count(cfg) / p.tp
    zero = p.zero_stage
    weight_bytes = 2 if t.precision == "bf16" else 4
    optimizer_bytes = 12 if t.precision == "bf16" else 8
    s, b, d = m.seq_len, t.micro_batch_size, m.d_model
    activations = sum(
        s * b * d * (10 + 24 / p.tp) + (5 * h * s * s * b / p.tp if m.attention_backend == "megatron" else 0)
        for h in cfg.heads_per_layer
    )
    activations += 8 * s * b * padded_vocab(cfg) / p.tp
    out = {
        "parameters": params * weight_bytes / (dp_size if zero >= 3 else 1),
        "gradients": params * 4 / (dp_size if zero >= 2 else 1),
        "optimizer": params * optimizer_bytes / (dp_size if zero >= 1 else 1),
        "activations": activations,
    }
    out["total"] = sum(out.values())
    return out


# --- milestones: what the kept checkpoints cost on disk -------------------------------------------------------
def checkpoint_bytes(cfg: Config) -> dict[str, float]:
    """Bytes of one checkpoint (all ranks together) by kind, as DeepSpeed ZeRO-1/2 writes them: the module's
    weights in the training dtype (mp_rank_*_model_states.pt, what eval and export read), plus in the
    optimizer files the fp32 master copy (DeepSpeed keeps one in fp32 runs too) and AdamW's two fp32 moments."""
    n = parameter_count(cfg)
    out = {"weights": n * (2 if cfg.train.precision == "bf16" else 4), "masters": n * 4.0, "moments": n * 8.0}
    out["total"] = sum(out.values())
    return out


def milestone_line(cfg: Config, steps: int) -> str:
    """The plan's line on milestone checkpoints (checkpoint.keep_every_steps): how many, their size on disk."""
    c, size = cfg.checkpoint, checkpoint_bytes(cfg)
    full = (
        f"a full one {size['total'] / 1e9:.2f} GB = weights {size['weights'] / 1e9:.2f} + fp32 masters "
        f"{size['masters'] / 1e9:.2f} + AdamW moments {size['moments'] / 1e9:.2f}"
    )
    if not c.keep_every_steps:
        return (
            f"  milestones   none (checkpoint.keep_every_steps=0); {full}, weights-only {size['weights'] / 1e9:.2f} GB"
        )
    total = cfg.steps(1)["total"]  # a branch's own steps are the last ``steps`` of its main run's numbering
    count = sum(is_milestone(s, c.keep_every_steps, total) for s in range(total - steps + 1, total + 1))
    thin = c.milestone_weights_only and cfg.parallel.zero_stage in (1, 2)  # checkpoint.commit.weights_only's condition
    each = size["weights"] if thin else size["total"]
    kind = "weights-only" if thin else "full (weights-only: checkpoint.milestone_weights_only, ZeRO-1/2)"
    return (
        f"  milestones   {count} (every {c.keep_every_steps:,} steps = {c.keep_every_steps * cfg.train.batch_tokens:,} "
        f"tokens, and the last), {kind}: {count * each / 1e9:,.1f} GB on disk; {full}"
    )


# --- the whole budget -------------------------------------------------------------------------------------
@dataclass
class Budget:
    nodes: int
    gpus_per_node: int
    world: int
    tp: int
    dp: int
    micro_batch: int
    grad_accum: int
    steps: int  # what this run trains: a cooldown branch's own steps after its main run's shared prefix
    warmup: int
    tokens: int
    shared_steps: int  # a branch's main run's steps before it (Config.steps' start), trained there; 0: a main run
    tokens_per_step: int
    epochs: float | None  # None: unknown
    epochs_source: str
    parameters: int
    memory: dict[str, float]
    flops_per_token: int
    mfu: float
    peak_flops: float | None  # per GPU, FLOP/s
    wall_seconds: float | None  # training steps only (validation and evals: pipeline.eval.plan)


def make_budget(
    cfg: Config,
    nodes: int = 1,
    gpus_per_node: int = 1,
    mfu: float = 0.4,
    peak_flops: float | None = None,
    manifest: dict[str, Any] | None = None,
) -> Budget:
    """The budget for ``nodes x gpus_per_node`` ranks; ``manifest`` (when prepared) gives the epochs."""
    if nodes < 1 or gpus_per_node < 1:
        raise ConfigError(f"--nodes {nodes} and --gpus-per-node {gpus_per_node} must be >= 1")
    if not 0 < mfu <= 1:
        raise ConfigError(f"--mfu {mfu} must be in (0, 1], e.g. 0.4")
    if peak_flops is not None and not (math.isfinite(peak_flops) and peak_flops > 0):
        raise ConfigError(f"peak FLOP/s {peak_flops} must be > 0, e.g. --peak-tflops 989")
    world = nodes * gpus_per_node
    dp = data_parallel_size(cfg, world)
    steps = cfg.steps(dp)  # the trainer's call: refuses a batch not divisible by seq_len x micro x DP
    if manifest is not None:
        n_epochs, source = epochs(cfg, manifest, dp), f"{cfg.data.dataset_dir} (manifest)"
    elif cfg.data.input in KNOWN_INPUT_TOKENS:
        n_epochs, source = trained_tokens(cfg) / KNOWN_INPUT_TOKENS[cfg.data.input], f"{cfg.data.input} (known size)"
    else:
        n_epochs, source = None, "unknown (not prepared, input size unknown)"
    peak = peak_flops if peak_flops is not None else cfg.train.peak_flops
    fpt = flops_per_token(cfg)
    own = steps["total"] - steps["start"]  # a branch trains from its main run's step start, not step 1
    tokens = own * cfg.train.batch_tokens  # what the loop trains: whole optimizer steps
    wall = fpt * tokens / (mfu * peak * world) if peak else None
    return Budget(
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        world=world,
        tp=cfg.parallel.tp,
        dp=dp,
        micro_batch=cfg.train.micro_batch_size,
        grad_accum=steps["grad_accum"],
        steps=own,
        warmup=max(0, steps["warmup"] - steps["start"]),
        tokens=tokens,
        shared_steps=steps["start"],
        tokens_per_step=cfg.train.batch_tokens,
        epochs=n_epochs,
        epochs_source=source,
        parameters=parameter_count(cfg),
        memory=memory_per_gpu(cfg, dp),
        flops_per_token=fpt,
        mfu=mfu,
        peak_flops=peak,
        wall_seconds=wall,
    )


def format_budget(cfg: Config, budget: Budget) -> str:
    m, mem = cfg.model, budget.memory
    epochs = (
        "unknown"
        if budget.epochs is None
        else f"{budget.epochs:.2f}" + (" (repeats data)" if budget.epochs > 1 else "")
    )
    lines = [
        f"plan: {cfg.run_name} ({cfg.source})",
        f"  world        {budget.world} GPUs = {budget.nodes} node(s) x {budget.gpus_per_node} = TP {budget.tp} x DP {budget.dp}",
        f"  batch        {budget.tokens_per_step:,} tokens/step = micro-batch {budget.micro_batch} x seq {m.seq_len} x "
        f"grad_accum {budget.grad_accum} x DP {budget.dp}",
        f"  steps        {budget.steps:,} optimizer steps, {budget.warmup:,} warmup",
        f"  LR schedule  {lr_schedule.describe(cfg)}",
        f"  tokens       {budget.tokens:,}",
        *shared_prefix_line(cfg, budget),
        f"  epochs       {epochs} of {budget.epochs_source}",
        f"  parameters   {budget.parameters:,}",
        f"  memory/GPU   {mem['total'] / GIB:.2f} GiB = parameters {mem['parameters'] / GIB:.2f} + gradients "
        f"{mem['gradients'] / GIB:.2f} + optimizer {mem['optimizer'] / GIB:.2f} + activations "
        f"{mem['activations'] / GIB:.2f} (ZeRO-{cfg.parallel.zero_stage}, {cfg.train.precision}; estimate)",
        f"  FLOPs/token  {budget.flops_per_token:,} (training, attention counted in full)",
        milestone_line(cfg, budget.steps),
    ]
    if budget.wall_seconds is None:
        lines.append(f"  wall time    unknown at MFU {budget.mfu:.0%}: pass --peak-tflops (e.g. 989 for H100 SXM bf16)")
    else:
        lines.append(
            f"  wall time    {duration(budget.wall_seconds)} at MFU {budget.mfu:.0%} of {budget.peak_flops / 1e12:,.0f} "
            f"TFLOP/s per GPU"
        )
    return "\n".join(lines)


def shared_prefix_line(cfg: Config, budget: Budget) -> list[str]:
    """A cooldown branch's main-run steps before it: trained by the main run, not counted in steps or time."""
    if not budget.shared_steps:
        return []
    return [
        f"  main run     steps 1-{budget.shared_steps:,} ({budget.shared_steps * budget.tokens_per_step:,} tokens) "
        f"shared with {cfg.main_run_dir}, trained there; this branch trains steps {budget.shared_steps + 1:,}-"
        f"{budget.shared_steps + budget.steps:,}"
    ]


def budget_json(budget: Budget) -> str:
    return json.dumps(budget.__dict__, indent=1)

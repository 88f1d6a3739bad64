"""Trainer overhead and loader throughput, measured in one run.

    python benchmarks/bench_train.py [--quick] [CONFIG] [overrides ...]   # default configs/tiny_prism.yaml
    python benchmarks/bench_train.py configs/tiny_prism.yaml data.dataset_dir=... data.tokenizer=... model.seq_len=128

1. Step time of the real trainer (`pipeline.train.train`: DeepSpeed engine, loader, logging, signal
   all-reduce) against a bare PyTorch loop over the same Megatron model, the same batches (same loader),
   plain torch AdamW and clip_grad_norm_, no DeepSpeed. Median step time over the steps after warm-up;
   target: prism train / bare <= 1.15.
2. The loader alone, pinned to one CPU core: tokens/s handed out (read + sha256 + tar parse + slicing +
   int64 conversion); target >= 20 M tokens/s.
3. What on-demand traces cost with profiling off (pipeline.profiling): the per-step check the loop runs (the
   sync-step rule, rank 0's look for profile/request.json, the no-op step context) and the second value the
   stop agreement's all-reduce carries, printed as a step-time ratio on/off.

Without a data.dataset_dir override it builds the tiny dataset (benchmarks/_common.py) in a temporary
folder; with one, that folder must hold a prepared dataset (`prism prepare CONFIG`). --quick: 4 timed steps
and 1 s of loader, well under a minute here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from _common import ROOT, refuse, report, say, tiny_dataset

PROG = "bench_train"


def bench_loader(cfg, seconds: float) -> float:
    from pipeline import data

    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core: thread + consumer share it
    loader = data.ShardLoader(cfg, dp_rank=0, dp_size=1, batch_size=cfg.train.micro_batch_size)
    loader.next_batch()  # thread started, first shard read
    tokens, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        tokens += loader.next_batch()[:, :-1].size
    rate = tokens / (time.perf_counter() - start)
    loader.close()
    return rate


def bare_step_times(cfg, steps: int) -> list[float]:
    import torch

    from pipeline import data, distributed
    from pipeline.lr_schedule import lr_at
    from pipeline.model import build_model, lm_loss
    from pipeline.train.engine import make_optimizer

    distributed.init_model_parallel(1, cfg.run.seed)
    model = build_model(cfg)
    opt = make_optimizer(cfg, model)
    plan = cfg.steps(1)
    loader = data.ShardLoader(cfg, dp_rank=0, dp_size=1, batch_size=cfg.train.micro_batch_size)
    times = []
    for step in range(steps):
        start = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, plan["total"], plan["warmup"], cfg.train.lr, cfg.train.min_lr)
        for _ in range(plan["grad_accum"]):
            loss = lm_loss(model, torch.from_numpy(loader.next_batch()))
            (loss / plan["grad_accum"]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        float(loss.detach())  # wait for the step, as the trainer does when it logs
        times.append(time.perf_counter() - start)
    loader.close()
    return times


def trainer_step_times(cfg) -> list[float]:
    from pipeline.train import train

    train(cfg)
    rows = [json.loads(line) for line in (cfg.checkpoint_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["perf/step_time"] for r in rows if "perf/step_time" in r]  # not the data/* row of a start


def profile_check_seconds(cfg, reps: int = 20_000) -> dict[str, float]:
    """What the loop pays per step for on-demand traces while none is asked for (pipeline.profiling): the
    sync-step rule, rank 0's look for request.json at sync steps, the no-op step context, and the second value
    the stop agreement's all-reduce now carries (timed against the one-value all-reduce it replaced)."""
    import torch
    import torch.distributed as dist

    from pipeline.cadence import step_actions
    from pipeline.profiling import Profiler
    from pipeline.tracking import NullTracker

    prof, total = Profiler(cfg, 0, "cpu", NullTracker()), cfg.steps(1)["total"]
    start = time.perf_counter()
    for i in range(reps):
        step = i % total + 1
        prof.agreed(prof.poll(step_actions(cfg, step, total).sync), step, total)
        with prof.step(step):
            pass
        prof.step_done(step)
    check = (time.perf_counter() - start) / reps
    reduce_s = {}
    for n in (1, 2):
        flag = torch.zeros(n)
        start = time.perf_counter()
        for _ in range(reps // 10):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        reduce_s[n] = (time.perf_counter() - start) / (reps // 10)
    return {"check": check, "second_value": reduce_s[2] - reduce_s[1]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", default=str(ROOT / "configs" / "tiny_prism.yaml"))
    p.add_argument("overrides", nargs="*")
    p.add_argument(
        "--quick",
        action="store_true",
        help="the CI size: --steps 3 --warmup 1 --loader-seconds 1, one micro-batch a step",
    )
    p.add_argument("--steps", type=int, default=None, help="timed steps per side (default 12, quick 3)")
    p.add_argument("--warmup", type=int, default=None, help="first steps left out of the medians (2, quick 1)")
    p.add_argument("--loader-seconds", type=float, default=None, help="loader timing (default 5, quick 1)")
    args = p.parse_args()
    sizes = {"steps": (12, 3), "warmup": (2, 1), "loader_seconds": (5.0, 1.0)}
    for key, (full, quick) in sizes.items():
        if getattr(args, key) is None:
            setattr(args, key, quick if args.quick else full)

    from pipeline import config
    from pipeline.config import ConfigError

    say(
        f"bench_train: median step time of prism train vs a bare PyTorch loop ({args.steps} steps after "
        f"{args.warmup} warm-up), then the loader alone on one core ({args.loader_seconds:g} s)"
    )
    with tempfile.TemporaryDirectory() as tmp:
        overrides = list(args.overrides)
        if not any(o.startswith("data.dataset_dir=") for o in overrides):
            overrides = tiny_dataset(Path(tmp) / "data") + overrides
        try:
            base = config.load(args.config, overrides)
            if args.quick:  # one micro-batch per step: the trainer's overhead per step, at a size CI can afford
                overrides.append(f"train.batch_tokens={base.model.seq_len * base.train.micro_batch_size}")
                base = config.load(args.config, overrides)
        except ConfigError as e:
            refuse(PROG, str(e))
        if not (Path(base.data.dataset_dir) / "manifest.json").is_file():
            refuse(
                PROG,
                f"data.dataset_dir={base.data.dataset_dir}: no manifest.json; run `prism prepare {args.config}` with "
                "the same overrides first, or leave data.dataset_dir out to use the tiny dataset",
            )
        steps = args.steps + args.warmup
        ov = [
            *overrides,
            f"run.output_dir={tmp}/run",
            "tracking.enabled=false",
            "train.log_every=1",
            f"train.train_tokens={steps * base.train.batch_tokens}",
            f"train.val_every={10 * steps}",
            # the last step validates: one val shard's worth, not the preset's val_tokens
            f"train.val_tokens={base.data.val_samples_per_shard * base.data.sequences_per_sample * base.model.seq_len}",
            f"checkpoint.every_steps={10 * steps}",
        ]
        cfg = config.load(args.config, ov)
        say(f"prism train: {steps} steps of {cfg.train.batch_tokens} tokens ({cfg.train.precision})")
        trainer = trainer_step_times(cfg)[args.warmup :]
        say("the per-step profile-request check with profiling off")
        off = profile_check_seconds(cfg)
        say(f"bare PyTorch loop: {steps} steps")
        bare = bare_step_times(cfg, steps)[args.warmup :]
        say(f"loader on one core: {args.loader_seconds:g} s")
        loader_rate = bench_loader(cfg, args.loader_seconds)
    ratio = statistics.median(trainer) / statistics.median(bare)
    result = {
        "config": args.config,
        "precision": cfg.train.precision,
        "zero_stage": cfg.parallel.zero_stage,
        "tokens_per_step": cfg.train.batch_tokens,
        "steps_timed": len(bare),
        "prism_train_step_s": round(statistics.median(trainer), 4),
        "bare_pytorch_step_s": round(statistics.median(bare), 4),
        "step_time_ratio": round(ratio, 3),
        "step_time_target": "<= 1.15",
        "loader_tokens_per_s_one_core": round(loader_rate),
        "loader_target": ">= 20e6",
        # with profiling off, what the on-demand trace check adds to a step: (step + check) / step
        "profile_check_us_per_step": round(1e6 * off["check"], 2),
        "profile_second_allreduce_value_us": round(1e6 * off["second_value"], 2),
        "step_time_ratio_check_on_over_off": round(
            (statistics.median(trainer) + off["check"] + max(0.0, off["second_value"])) / statistics.median(trainer), 6
        ),
    }
    print(json.dumps(result, indent=1))
    report(PROG, result)


if __name__ == "__main__":
    main()

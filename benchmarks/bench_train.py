"""Trainer overhead and loader throughput, measured in one run.

    python benchmarks/bench_train.py [CONFIG] [overrides ...]      # default configs/tiny_prism.yaml
    python benchmarks/bench_train.py configs/tiny_prism.yaml data.dataset_dir=... data.tokenizer=... model.seq_len=128

1. Step time of the real trainer (`pipeline.train.train`: DeepSpeed engine, loader, logging, signal
   all-reduce) against a bare PyTorch loop over the same Megatron model, the same batches (same loader),
   plain torch AdamW and clip_grad_norm_, no DeepSpeed. Median step time over the steps after warm-up;
   target: prism train / bare <= 1.15.
2. The loader alone, pinned to one CPU core: tokens/s handed out (read + sha256 + tar parse + slicing +
   int64 conversion); target >= 20 M tokens/s.

Needs a prepared dataset (`prism prepare CONFIG`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


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
    from pipeline.model import build_model, lm_loss
    from pipeline.train import lr_at, make_optimizer

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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", default=str(ROOT / "configs" / "tiny_prism.yaml"))
    p.add_argument("overrides", nargs="*")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians")
    p.add_argument("--loader-seconds", type=float, default=5.0)
    args = p.parse_args()

    from pipeline import config

    with tempfile.TemporaryDirectory() as tmp:
        base = config.load(args.config, args.overrides)
        steps = args.steps + args.warmup
        ov = [
            *args.overrides,
            f"run.output_dir={tmp}",
            "tracking.enabled=false",
            "train.log_every=1",
            f"train.train_tokens={steps * base.train.batch_tokens}",
            f"train.val_every={10 * steps}",
            f"checkpoint.every_steps={10 * steps}",
        ]
        cfg = config.load(args.config, ov)
        trainer = trainer_step_times(cfg)[args.warmup :]
        bare = bare_step_times(cfg, steps)[args.warmup :]
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
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

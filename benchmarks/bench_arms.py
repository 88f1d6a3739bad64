"""Both arms through the real trainer path: tokens/s, Prism/uniform ratio, MFU, peak memory, SDPA kernels,
a torch-profiler split of step time, and each layer's forward and backward time (a table, both arms).

    python benchmarks/bench_arms.py                                  # tiny presets on CPU, 6 steps per arm
    python benchmarks/bench_arms.py --scale 124m --steps 40          # GPU: bf16, the preset's batch
    python benchmarks/bench_arms.py --scale 757m --steps 20 --nproc 1 [overrides ...]
    python benchmarks/bench_arms.py --quick                          # the CI size: tiny on CPU, 4 steps of 1024 tokens

Each arm is one `prism train` (pipeline.cli) under torchrun (NCCL on GPU, gloo on CPU), DeepSpeed ZeRO as the
preset says, on a synthetic dataset of uniform random tokens written in the prepared-data format (manifest +
webdataset shards), so the loader, the engine, the step and the logging are the trainer's own. Figures come
from the trainer's metrics.jsonl (perf/train_tokens_per_sec, perf/mfu, perf/mfu_causal, perf/memory_gb) and its log (the SDPA kernel
chosen per head dim, pipeline.model.sdpa_backend); nothing is recomputed here. The last --profile-steps
training steps run under torch.profiler (self time per op: device kernels on CUDA, CPU ops on CPU) and are
left out of tokens/s (with the profiler's own warm-up step before them), as are the first --warmup steps.
Each transformer layer's forward and backward run inside named profiler ranges (pipeline.profiling.label_layers,
the ranges the trainer's own traces have): their time per step, wall time on CPU and the kernels launched in
them on CUDA, is the per-layer table, so a Prism slowdown shows in the layers that cause it.

Output: one line per field (`arm <name> <field> <value>`), a `ratio` line and a final `BENCH_ARMS {json}`
line with everything (also written to --json). MFU needs a known peak: on CPU pass --peak-flops (nominal).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from _common import ROOT, refuse, report, say

SYNTH_TOKENIZER = "synthetic-uniform-tokens"  # not a file: the data check compares names only
SDPA_LOG = re.compile(r"attention: SDPA kernel per head dim on .*?: (d_h .*)$", re.M)


# --- the synthetic dataset ---------------------------------------------------------------------------
def write_synthetic_dataset(cfg, out: Path, train_tokens: int, shards_at_least: int) -> None:
    """Uniform random tokens in the prepared-data format, with one epoch >= train_tokens."""
    import numpy as np

    from pipeline.dataset import FORMAT_VERSION, dtype_for_vocab, shard_key, shard_name

    m, d = cfg.model, cfg.data
    dtype = dtype_for_vocab(m.vocab_size)
    rng = np.random.default_rng(0)
    sample_tokens = d.sequences_per_sample * m.seq_len

    def split(name: str, shards: int, per_shard: int) -> dict:
        entries = []
        for s in range(shards):
            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w") as tar:
                for i in range(per_shard):
                    rows = rng.integers(0, m.vocab_size, size=(d.sequences_per_sample, m.seq_len + 1))
                    payload = rows.astype(dtype).tobytes()
                    info = tarfile.TarInfo(f"{shard_key(name, 0, s)}-{i:06d}.tokens")
                    info.size = len(payload)
                    tar.addfile(info, io.BytesIO(payload))
            rel = shard_name(name, 0, s)
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            (out / rel).write_bytes(buf.getvalue())
            sha = hashlib.sha256(buf.getvalue()).hexdigest()
            entries.append({"path": rel, "sha256": sha, "samples": per_shard})
        return {"samples_per_shard": per_shard, "shards": entries}

    train_shards = max(shards_at_least, math.ceil(train_tokens / (sample_tokens * d.samples_per_shard)) + 1)
    manifest = {
        "format_version": FORMAT_VERSION,
        "dtype": dtype,
        "seq_len": m.seq_len,
        "sequences_per_sample": d.sequences_per_sample,
        "config": {"data.tokenizer": SYNTH_TOKENIZER},
        "tokenizer": {"name_or_path": SYNTH_TOKENIZER, "vocab_size": m.vocab_size, "eos_id": 0, "sha256": "none"},
        "splits": {
            "train": split("train", train_shards, d.samples_per_shard),
            "val": split("val", 1, d.val_samples_per_shard),
        },
    }
    (out / "manifest.json").write_text(json.dumps(manifest))


# --- the profiled trainer (runs under torchrun) ------------------------------------------------------
def op_kind(name: str) -> str:
    n = name.lower()
    if any(s in n for s in ("scaled_dot_product", "flash", "fmha", "attention", "cudnn")):
        return "attention"
    if any(s in n for s in ("gemm", "mm", "matmul", "linear", "nvjet", "cutlass", "xmma", "cublas", "sm90_")):
        return "matmul"
    return "other"


def profile_worker(profile_out: str, profile_steps: int, total_steps: int, argv: list[str]) -> int:
    """`prism train ARGV` with torch.profiler active over its last `profile_steps` training steps."""
    import logging

    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    import pipeline.train as trainer
    from pipeline.cli import main
    from pipeline.profiling import label_layers, layer_times

    cuda = torch.cuda.is_available() and "train.device=cpu" not in argv
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    wait = max(0, total_steps - profile_steps - 1)
    prof = profile(activities=activities, schedule=schedule(wait=wait, warmup=1, active=profile_steps, repeat=1))
    plain_step = trainer.train_step
    labels: list = []

    def profiled_step(engine, *args, **kwargs):
        if not labels:  # named ranges per layer (pipeline.profiling), as the trainer's own traces have
            labels.extend(label_layers(engine.module))
        result = plain_step(engine, *args, **kwargs)
        prof.step()
        return result

    trainer.train_step = profiled_step  # train() looks the step up in its module on every call
    for name in ("pipeline.model.sdpa_backend", "pipeline.train"):  # the SDPA kernels and the optimizer line
        logging.getLogger(name).addHandler(logging.StreamHandler(sys.stdout))
        logging.getLogger(name).setLevel(logging.INFO)
    prof.start()
    try:
        code = main(["train", *argv])
    finally:
        prof.stop()
    if int(os.environ.get("RANK", "0")) == 0:
        split = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
        for event in prof.key_averages():
            us = event.self_device_time_total if cuda else event.self_cpu_time_total
            # CPU-side launch ops are not step time on CUDA; kernels are device events there
            if cuda and us <= 0:
                continue
            split[op_kind(event.key)] += us / 1e3
        layers = {
            i: {k: v / profile_steps for k, v in t.items()}
            for i, t in layer_times(prof, "cuda" if cuda else "cpu").items()
        }
        on = "cuda kernels" if cuda else "cpu ops"
        Path(profile_out).write_text(json.dumps({"ms": split, "on": on, "layer_ms_per_step": layers}))
    return code


# --- one arm -----------------------------------------------------------------------------------------
def run_arm(args, config_path: str, overrides: list[str], workdir: Path) -> dict:
    from pipeline import config

    cfg = config.load(config_path, overrides)
    log_path = workdir / f"{cfg.run_name}.log"
    profile_out = workdir / f"{cfg.run_name}.profile.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}"]
    cmd += [__file__, "--profile-worker", str(profile_out), str(args.profile_steps), str(args.steps)]
    cmd += [config_path, *overrides]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with log_path.open("w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT).returncode
    text = log_path.read_text()
    if rc != 0:
        raise SystemExit(f"bench_arms: {config_path} exited {rc}; last lines of {log_path}:\n" + text[-3000:])
    rows = [json.loads(line) for line in (cfg.checkpoint_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "perf/train_tokens_per_sec" in r]
    # the profiler's own warm-up step runs traced too: leave it out with the profiled steps
    counted = rows[args.warmup : len(rows) - args.profile_steps - 1] or rows
    found = SDPA_LOG.search(text)
    profile = json.loads(profile_out.read_text())
    total = sum(profile["ms"].values()) or 1.0

    def median(key: str) -> float | None:
        values = [r[key] for r in counted if r.get(key) is not None]
        return statistics.median(values) if values else None

    return {
        "config": config_path,
        "heads_per_layer": list(cfg.heads_per_layer),
        "steps_logged": len(rows),
        "steps_counted": len(counted),
        "tokens_per_sec": median("perf/train_tokens_per_sec"),
        "step_time_s": median("perf/step_time"),
        "mfu": median("perf/mfu"),
        "mfu_causal": median("perf/mfu_causal"),
        "peak_memory_gb": max(r["perf/memory_gb"] for r in rows),
        "final_loss": rows[-1]["train/loss"],
        "sdpa": found.group(1).strip() if found else "not logged (model.attention_backend=megatron?)",
        "profile_on": profile["on"],
        "profile_ms": {k: round(v, 3) for k, v in profile["ms"].items()},
        "profile_share": {k: round(v / total, 4) for k, v in profile["ms"].items()},
        "layer_ms_per_step": {int(i): t for i, t in profile["layer_ms_per_step"].items()},
    }


def layer_table(result: dict) -> str:
    """Forward and backward ms per step of each layer, both arms side by side, with Prism's d_h and the ratio."""
    uni, pri = result["arms"]["uniform"], result["arms"]["prism"]
    d_model = result["d_model"]
    rows = [
        "| layer | prism d_h | uniform fwd ms | prism fwd ms | uniform bwd ms | prism bwd ms | prism/uniform fwd+bwd |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, h in enumerate(pri["heads_per_layer"], start=1):
        u, p = uni["layer_ms_per_step"].get(i, {}), pri["layer_ms_per_step"].get(i, {})
        su, sp = u.get("forward", 0) + u.get("backward", 0), p.get("forward", 0) + p.get("backward", 0)
        cells = [u.get("forward", 0), p.get("forward", 0), u.get("backward", 0), p.get("backward", 0)]
        ratio = f"{sp / su:.3f}" if su else "n/a"
        rows.append(f"| {i} | {d_model // h} | " + " | ".join(f"{c:.2f}" for c in cells) + f" | {ratio} |")
    return "\n".join(rows)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--profile-worker":
        out, k, n, *rest = sys.argv[2:]
        raise SystemExit(profile_worker(out, int(k), int(n), rest))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", default="tiny", help="tiny | 124m | 354m | 757m (configs/{prism,uniform}_SCALE)")
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps per arm")
    ap.add_argument("--warmup", type=int, default=1, help="first steps left out of tokens/s")
    ap.add_argument("--profile-steps", type=int, default=2, help="last steps run under the profiler")
    ap.add_argument("--batch-tokens", type=int, default=None, help="default: the preset's train.batch_tokens")
    ap.add_argument("--nproc", type=int, default=1, help="processes (GPUs) per arm")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--peak-flops", type=float, default=None, help="per device; default: the trainer's table")
    ap.add_argument("--workdir", default=None, help="default: a temporary folder, removed afterwards")
    ap.add_argument("--json", default=None, help="also write the result here")
    ap.add_argument("--quick", action="store_true", help="tiny on CPU: --steps 4 --profile-steps 1, 1024-token steps")
    ap.add_argument("overrides", nargs="*", help="config overrides for both arms (key=value)")
    args = ap.parse_args()
    if args.quick:
        args.scale, args.device, args.steps, args.warmup, args.profile_steps = "tiny", "cpu", 4, 1, 1
        args.batch_tokens = args.batch_tokens or 1024  # one micro-batch of the tiny preset
        args.peak_flops = args.peak_flops or 1e12  # nominal: the MFU fields are printed, not judged
    if args.steps < args.warmup + args.profile_steps + 2:
        refuse("bench_arms", f"--steps must be >= warmup + profile-steps + 2 = {args.warmup + args.profile_steps + 2}")
    say(f"bench_arms: {args.scale}, both arms through prism train; loading torch")

    import torch

    from pipeline import config

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    arms = {
        a: f"configs/{'tiny_' + a if args.scale == 'tiny' else a + '_' + args.scale}.yaml" for a in ("uniform", "prism")
    }
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench_arms-"))
    workdir.mkdir(parents=True, exist_ok=True)
    data_dir = workdir / "data"
    overrides = [f"train.device={device}"] + (["train.precision=bf16"] if device == "cuda" else [])
    overrides += list(args.overrides)
    try:
        probe = config.load(arms["prism"], overrides)
    except config.ConfigError as e:
        refuse("bench_arms", str(e))
    batch_tokens = args.batch_tokens or probe.train.batch_tokens
    overrides += [
        f"run.output_dir={workdir / 'runs'}",
        f"data.dataset_dir={data_dir}",
        f"data.tokenizer={SYNTH_TOKENIZER}",
        "data.verify_on_start=false",
        "data.val_sets={}",  # the synthetic dataset's own val split is the one validation set
        "tracking.enabled=false",
        "train.log_every=1",  # one metrics row per step; a log step reads back once per step
        f"train.batch_tokens={batch_tokens}",
        f"train.train_tokens={args.steps * batch_tokens}",
        f"train.val_tokens={probe.data.val_samples_per_shard * probe.data.sequences_per_sample * probe.model.seq_len}",
        "train.val_every=1000000000",
        "checkpoint.every_steps=1000000000",
        "checkpoint.keep_last=1",
    ] + ([f"train.peak_flops={args.peak_flops}"] if args.peak_flops else [])
    try:
        probe = config.load(arms["prism"], overrides)
    except config.ConfigError as e:  # --batch-tokens is checked here
        refuse("bench_arms", str(e))
    write_synthetic_dataset(probe, data_dir, args.steps * batch_tokens, shards_at_least=2 * args.nproc)

    result = {
        "scale": args.scale,
        "device": device,
        "precision": probe.train.precision,
        "nproc": args.nproc,
        "steps": args.steps,
        "batch_tokens": batch_tokens,
        "seq_len": probe.model.seq_len,
        "d_model": probe.model.d_model,
        "arms": {},
    }
    say(
        f"bench_arms: tokens/s, MFU, peak memory, SDPA kernels and a profile of both arms ({args.scale}, {device}, "
        f"{args.steps} steps x {batch_tokens} tokens), each a prism train under torchrun"
    )
    try:
        for arm, path in arms.items():
            say(f"arm {arm}: {path}")
            result["arms"][arm] = run_arm(args, path, overrides, workdir)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            shutil.rmtree(workdir / "data", ignore_errors=True)
    uni, pri = result["arms"]["uniform"], result["arms"]["prism"]
    result["ratio_prism_over_uniform_tokens_per_sec"] = pri["tokens_per_sec"] / uni["tokens_per_sec"]

    def pct(x):
        return "n/a (no peak: --peak-flops)" if x is None else f"{100 * x:.1f}%"

    print(
        f"bench_arms: {args.scale} on {device} ({result['precision']}), {args.nproc} process(es), "
        f"{args.steps} steps x {batch_tokens} tokens, seq {result['seq_len']}; medians over steps "
        f"{args.warmup + 1}..{args.steps - args.profile_steps - 1}"
    )
    for arm, r in result["arms"].items():
        print(f"arm {arm} tokens_per_sec {r['tokens_per_sec']:,.0f}")
        print(f"arm {arm} mfu {pct(r['mfu'])} (causal-halved {pct(r['mfu_causal'])})")
        print(f"arm {arm} peak_memory_gb {r['peak_memory_gb']:.2f}")
        print(f"arm {arm} sdpa {r['sdpa']}")
        print(
            f"arm {arm} profile ({r['profile_on']}, {args.profile_steps} steps) "
            + ", ".join(f"{k} {v:.1f} ms ({100 * r['profile_share'][k]:.0f}%)" for k, v in r["profile_ms"].items())
        )
    print(f"ratio prism/uniform tokens_per_sec {result['ratio_prism_over_uniform_tokens_per_sec']:.3f}")
    print(f"per-layer time per step under the profiler ({uni['profile_on']}; {args.profile_steps} steps):")
    print(layer_table(result))
    report("bench_arms", result)
    print("BENCH_ARMS " + json.dumps(result))  # last: gpu_bench.sh and the integration test read it
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

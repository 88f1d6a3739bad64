"""Forward+backward tokens/s of the Prism arm over its uniform twin, measured in one run.

    python benchmarks/bench_model.py                      # tiny preset (+ 124M on CPU, a few steps)
    python benchmarks/bench_model.py --presets tiny       # only the tiny preset
    python benchmarks/bench_model.py --presets 124m --batch 8 --steps 10   # on a GPU: 124M in bf16
    python benchmarks/bench_model.py --quick              # the CI size: tiny, batch 4, 3 steps per arm

Steps of the two arms alternate (prism, uniform, prism, ...) so machine noise hits both alike; the
median step time per arm gives the ratio. Target: prism / uniform >= 0.99.
"""

from __future__ import annotations

import argparse
import statistics
import time

from _common import announce, refuse, report, say

announce(__name__, __doc__)  # before torch loads

import torch  # noqa: E402

from pipeline import config, distributed  # noqa: E402
from pipeline.model import build_model, lm_loss  # noqa: E402
from pipeline.model.report import uniform_twin  # noqa: E402

PRESETS = {"tiny": "configs/tiny_prism.yaml", "124m": "configs/prism_124m.yaml"}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def bench(preset: str, batch: int, steps: int, seq_len: int | None) -> dict:
    overrides = [f"model.seq_len={seq_len}"] if seq_len else []
    if not torch.cuda.is_available():
        overrides.append("train.precision=fp32")  # CPU: fp32 (bf16 matmuls differ in speed by kernel)
    prism = config.load(PRESETS[preset], overrides)
    arms = {"prism": prism, "uniform": uniform_twin(prism)}
    distributed.init_model_parallel(1, prism.run.seed)
    models = {name: build_model(cfg).train() for name, cfg in arms.items()}
    device = next(models["prism"].parameters()).device
    tokens = torch.randint(0, prism.model.vocab_size, (batch, prism.model.seq_len + 1), device=device)
    times: dict[str, list[float]] = {name: [] for name in arms}
    for step in range(steps + 1):  # step 0 warms up (allocator, kernels, rope tables)
        for name, model in models.items():
            sync()
            start = time.perf_counter()
            lm_loss(model, tokens).backward()
            sync()
            if step:
                times[name].append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
    tok = batch * prism.model.seq_len
    rate = {name: tok / statistics.median(t) for name, t in times.items()}
    return {
        "preset": preset,
        "device": str(device),
        "precision": prism.train.precision,
        "batch": batch,
        "seq_len": prism.model.seq_len,
        "steps": steps,
        **{f"{n}_tok_s": r for n, r in rate.items()},
        "ratio": rate["prism"] / rate["uniform"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["tiny", "124m"], choices=sorted(PRESETS))
    p.add_argument("--batch", type=int, default=None, help="default: 8 for tiny, 1 (CPU) / 8 (GPU) for 124m")
    p.add_argument("--steps", type=int, default=None, help="timed steps per arm (default: 10 tiny, 3 124m)")
    p.add_argument("--seq-len", type=int, default=None, help="override model.seq_len")
    p.add_argument("--quick", action="store_true", help="tiny only, batch 4, 3 steps per arm (under a minute)")
    args = p.parse_args()
    if args.quick:
        args.presets, args.batch, args.steps = ["tiny"], args.batch or 4, args.steps or 3
    if min(args.batch or 1, args.steps or 1, args.seq_len or 1) < 1:
        refuse("bench_model", "--batch, --steps and --seq-len must be >= 1")
    for preset in args.presets:
        small = preset == "tiny" or torch.cuda.is_available()
        batch = args.batch or (8 if small else 1)
        steps = args.steps or (10 if small else 3)
        say(f"bench_model: {preset}, fwd+bwd tokens/s of the prism arm and its uniform twin, {steps} steps/arm")
        r = bench(preset, batch, steps, args.seq_len)
        print(
            f"{r['preset']:>5} on {r['device']} ({r['precision']}, batch {r['batch']} x {r['seq_len']}, "
            f"{r['steps']} steps/arm): prism {r['prism_tok_s']:,.0f} tok/s, uniform {r['uniform_tok_s']:,.0f} "
            f"tok/s, ratio prism/uniform = {r['ratio']:.3f}",
            flush=True,
        )
        report("bench_model", r)


if __name__ == "__main__":
    main()

"""Peak memory and time of the loss path: megatron's fp32 cross-entropy vs the chunked projection + loss, in one run.

    python benchmarks/bench_loss.py                       # 124M shape (d 768, vocab 50304), micro-batch 4, seq 1024
    python benchmarks/bench_loss.py --dtype fp32 --batch 2

The loss path is what `lm_loss` adds on top of the decoder: the (tied) output projection of the final
hidden states [s, b, d], (before) megatron's [s, b, V] -> [b, s, V] copy, the cross-entropy, and backward
down to the hidden states and the weight. Arms run alternately in this process. Peak memory on CPU = the peak resident
set size (VmHWM, reset through /proc/self/clear_refs before each repetition) minus the resident size before
it: large tensors are mmap-ed by glibc and returned on free, so RSS follows the live tensors. On CUDA the
allocator's max_memory_allocated is used. The figure to beat: the drop must be at least one fp32 copy of the
logits (b * s * V * 4 bytes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def rss_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak(device: str) -> int:
    """Reset the peak counter; return the memory in use now."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    return rss_bytes("VmRSS")


def peak(device: str) -> int:
    if device == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    return rss_bytes("VmHWM")


def megatron_path(hidden, weight, targets):
    """Before: GPTModel returned [b, s, V] logits (a copy of [s, b, V]); lm_loss took megatron's fp32 CE."""
    from megatron.core import tensor_parallel

    logits = (hidden @ weight.t()).transpose(0, 1).contiguous()
    return tensor_parallel.vocab_parallel_cross_entropy(logits.float(), targets).mean()


def chunked_path(hidden, weight, targets):
    """After: lm_loss projects and takes the loss a chunk of tokens at a time (pipeline.model.loss)."""
    from pipeline.model.loss import linear_cross_entropy

    return linear_cross_entropy(hidden, weight, targets.t())  # hidden is [s, b, d]


def loss_path(path, hidden, weight, targets):
    loss = path(hidden, weight, targets)
    loss.backward()
    return loss.detach()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--vocab", type=int, default=50304, help="padded vocab (GPT-2 50257 -> 50304)")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="the model's dtype (124M: bf16)")
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()

    from pipeline import distributed

    distributed.init_model_parallel(1, 1234)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.seq_len, args.batch, args.d_model, generator=gen).to(device, dtype)
    weight = (0.02 * torch.randn(args.vocab, args.d_model, generator=gen)).to(device, dtype)
    targets = torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=gen).to(device)
    hidden.requires_grad_()
    weight.requires_grad_()
    arms = {"megatron_fp32": megatron_path, "chunked": chunked_path}
    mem: dict[str, list[int]] = {a: [] for a in arms}
    secs: dict[str, list[float]] = {a: [] for a in arms}
    losses: dict[str, float] = {}
    for _ in range(args.reps):
        for name, fn in arms.items():
            hidden.grad = weight.grad = None
            base = reset_peak(device)
            start = time.perf_counter()
            loss = loss_path(fn, hidden, weight, targets)
            if device == "cuda":
                torch.cuda.synchronize()
            secs[name].append(time.perf_counter() - start)
            mem[name].append(peak(device) - base)
            losses[name] = float(loss)
    fp32_logits = args.batch * args.seq_len * args.vocab * 4
    old, new = min(mem["megatron_fp32"]), min(mem["chunked"])
    result = {
        "device": device,
        "dtype": args.dtype,
        "shape": f"b={args.batch} s={args.seq_len} d={args.d_model} V={args.vocab}",
        "loss_megatron_fp32": losses["megatron_fp32"],
        "loss_chunked": losses["chunked"],
        "loss_rel_diff": abs(losses["chunked"] - losses["megatron_fp32"]) / abs(losses["megatron_fp32"]),
        "peak_mb_megatron_fp32": round(old / 2**20),
        "peak_mb_chunked": round(new / 2**20),
        "peak_drop_mb": round((old - new) / 2**20),
        "fp32_logits_mb": round(fp32_logits / 2**20),
        "drop_over_fp32_logits": round((old - new) / fp32_logits, 2),
        "peak_ratio_chunked_over_megatron": round(new / old, 3),
        "step_s_megatron_fp32": round(statistics.median(secs["megatron_fp32"]), 3),
        "step_s_chunked": round(statistics.median(secs["chunked"]), 3),
        "time_ratio_chunked_over_megatron": round(
            statistics.median(secs["chunked"]) / statistics.median(secs["megatron_fp32"]), 3
        ),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

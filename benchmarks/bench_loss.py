"""Peak tensor memory and time of the loss path: megatron's fp32 cross-entropy vs the chunked projection + loss.

    python benchmarks/bench_loss.py            # memory at the 124M shape (d 768, vocab 50304, micro-batch 4,
                                               # seq 1024) in bf16 and fp32; time at batch 1 x 1024 on CPU
    python benchmarks/bench_loss.py --quick    # the same memory figures; time at batch 1 x 256, one repetition

The loss path is what `lm_loss` adds on top of the decoder: the (tied) output projection of the final
hidden states [s, b, d], (before) megatron's [s, b, V] -> [b, s, V] copy, the cross-entropy, and backward
down to the hidden states and the weight.

Memory is counted, not sampled: a TorchDispatchMode adds the bytes of every storage an op creates and
subtracts them when the storage is freed, so the peak is the most tensor bytes alive at once on top of the
inputs (hidden, weight, targets). Peak RSS on a CPU follows glibc's caching, not the tensors. The count runs
on the meta device, where ops allocate nothing and take no time, so the full 124M shape costs nothing in
either dtype (the chunked path then uses its CPU chunk size; on CUDA the allocator's peak is printed too).
The figure to beat: the drop must be at least one fp32 copy of the logits (b * s * V * 4 bytes).

Time and the two losses' agreement come from real runs of the arms, alternated, median of --reps. On CPU they
run in fp32 at --time-batch (bf16 matmuls on a CPU time a kernel no GPU uses).
"""

from __future__ import annotations

import argparse
import statistics
import time
import weakref

from _common import announce, refuse, report, say

announce(__name__, __doc__)  # before torch loads

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class LiveTensorBytes(TorchDispatchMode):
    """Bytes of the storages created under this mode that are still alive, and their peak."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._counted: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._count(t.untyped_storage())
        return out

    def _count(self, storage) -> None:
        # views and in-place results share a storage, counted once; torch keeps one Python object per
        # storage while the storage lives, so its finalizer runs when the memory is released
        key = id(storage)
        if key in self._counted:
            return
        self._counted.add(key)
        self.live += storage.nbytes()
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._release, key, storage.nbytes())

    def _release(self, key: int, nbytes: int) -> None:
        self._counted.discard(key)
        self.live -= nbytes


def megatron_path(hidden, weight, targets):
    """Before: GPTModel returned [b, s, V] logits (a copy of [s, b, V]); lm_loss took megatron's fp32 CE."""
    from megatron.core import tensor_parallel

    logits = (hidden @ weight.t()).transpose(0, 1).contiguous()
    return tensor_parallel.vocab_parallel_cross_entropy(logits.float(), targets).mean()


def chunked_path(hidden, weight, targets):
    """After: lm_loss projects and takes the loss a chunk of tokens at a time (pipeline.model.loss)."""
    from pipeline.model.loss import linear_cross_entropy

    return linear_cross_entropy(hidden, weight, targets.t())  # hidden is [s, b, d]


ARMS = {"megatron_fp32": megatron_path, "chunked": chunked_path}


def inputs(batch: int, seq_len: int, d_model: int, vocab: int, dtype: torch.dtype, device: str):
    gen = torch.Generator().manual_seed(0)
    if device == "meta":
        hidden = torch.empty(seq_len, batch, d_model, dtype=dtype, device=device)
        weight = torch.empty(vocab, d_model, dtype=dtype, device=device)
        targets = torch.zeros(batch, seq_len, dtype=torch.long, device=device)
    else:
        hidden = torch.randn(seq_len, batch, d_model, generator=gen).to(device, dtype)
        weight = (0.02 * torch.randn(vocab, d_model, generator=gen)).to(device, dtype)
        targets = torch.randint(0, vocab, (batch, seq_len), generator=gen).to(device)
    return hidden.requires_grad_(), weight.requires_grad_(), targets


def loss_and_backward(path, hidden, weight, targets) -> torch.Tensor:
    hidden.grad = weight.grad = None
    loss = path(hidden, weight, targets)
    loss.backward()
    return loss.detach()


def counted_peak(path, hidden, weight, targets) -> int:
    with LiveTensorBytes() as mode:
        loss_and_backward(path, hidden, weight, targets)
    return mode.peak


def memory(args, dtype_name: str) -> dict:
    """Counted peaks of both arms at the full shape, on the meta device."""
    x = inputs(args.batch, args.seq_len, args.d_model, args.vocab, DTYPES[dtype_name], "meta")
    peaks = {name: counted_peak(path, *x) for name, path in ARMS.items()}
    old, new = peaks["megatron_fp32"], peaks["chunked"]
    fp32_logits = args.batch * args.seq_len * args.vocab * 4
    return {
        f"{dtype_name}_peak_mb_megatron_fp32": round(old / 2**20),
        f"{dtype_name}_peak_mb_chunked": round(new / 2**20),
        f"{dtype_name}_peak_drop_mb": round((old - new) / 2**20),
        f"{dtype_name}_drop_over_fp32_logits": round((old - new) / fp32_logits, 2),
        f"{dtype_name}_peak_ratio_chunked_over_megatron": round(new / old, 3),
    }


def timing(args, device: str) -> dict:
    """Both arms alternated on the real device: median seconds, the losses, and the counted peak there."""
    dtype_name = args.dtype if device == "cuda" else "fp32"
    batch = args.batch if device == "cuda" else args.time_batch
    seq_len = args.seq_len if device == "cuda" else args.time_seq_len
    x = inputs(batch, seq_len, args.d_model, args.vocab, DTYPES[dtype_name], device)
    secs: dict[str, list[float]] = {a: [] for a in ARMS}
    losses: dict[str, float] = {}
    for rep in range(args.reps):
        for name, path in ARMS.items():
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            loss = loss_and_backward(path, *x)
            if device == "cuda":
                torch.cuda.synchronize()
            secs[name].append(time.perf_counter() - start)
            losses[name] = float(loss)
        say(f"time: repetition {rep + 1}/{args.reps} done")
    result = {
        "time_device": device,
        "time_dtype": dtype_name,
        "time_shape": f"b={batch} s={seq_len} d={args.d_model} V={args.vocab}",
        "loss_megatron_fp32": losses["megatron_fp32"],
        "loss_chunked": losses["chunked"],
        "loss_rel_diff": abs(losses["chunked"] - losses["megatron_fp32"]) / abs(losses["megatron_fp32"]),
        "step_s_megatron_fp32": round(statistics.median(secs["megatron_fp32"]), 4),
        "step_s_chunked": round(statistics.median(secs["chunked"]), 4),
        "time_ratio_chunked_over_megatron": round(
            statistics.median(secs["chunked"]) / statistics.median(secs["megatron_fp32"]), 3
        ),
    }
    if device == "cuda":
        for name, path in ARMS.items():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            loss_and_backward(path, *x)
            result[f"cuda_allocator_peak_mb_{name}"] = round((torch.cuda.max_memory_allocated() - base) / 2**20)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=4, help="micro-batch of the memory count (and of the CUDA timing)")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--vocab", type=int, default=50304, help="padded vocab (GPT-2 50257 -> 50304)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="the CUDA timing's dtype (124M: bf16)")
    p.add_argument("--time-batch", type=int, default=1, help="CPU timing: micro-batch")
    p.add_argument("--time-seq-len", type=int, default=None, help="CPU timing: sequence length (1024, quick 256)")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions per arm (3, quick 1)")
    p.add_argument("--quick", action="store_true", help="time a 256-token sequence once (under a minute)")
    args = p.parse_args()
    args.time_seq_len = args.time_seq_len or (256 if args.quick else 1024)
    args.reps = args.reps or (1 if args.quick else 3)
    if min(args.batch, args.seq_len, args.d_model, args.vocab, args.time_batch, args.time_seq_len, args.reps) < 1:
        refuse("bench_loss", "--batch, --seq-len, --d-model, --vocab, --time-batch, --time-seq-len, --reps: >= 1")

    from pipeline import distributed

    distributed.init_model_parallel(1, 1234)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = f"b={args.batch} s={args.seq_len} d={args.d_model} V={args.vocab}"
    say(f"bench_loss: peak tensor bytes (counted on the meta device) of megatron's fp32 CE vs chunked, {shape}")
    result = {"shape": shape, "fp32_logits_mb": round(args.batch * args.seq_len * args.vocab * 4 / 2**20)}
    for dtype_name in ("bf16", "fp32"):
        result.update(memory(args, dtype_name))
        say(
            f"memory {dtype_name}: megatron_fp32 {result[f'{dtype_name}_peak_mb_megatron_fp32']} MB, chunked "
            f"{result[f'{dtype_name}_peak_mb_chunked']} MB (fp32 logits {result['fp32_logits_mb']} MB)"
        )
    say(f"time: both arms alternated on {device}, {args.reps} repetition(s)")
    result.update(timing(args, device))
    say(
        f"time: megatron_fp32 {result['step_s_megatron_fp32']} s, chunked {result['step_s_chunked']} s, ratio "
        f"{result['time_ratio_chunked_over_megatron']}; loss rel diff {result['loss_rel_diff']:.2e}"
    )
    report("bench_loss", result)


if __name__ == "__main__":
    main()

"""No host sync outside sync steps: real DeepSpeed (ZeRO-1) steps of the trainer, with every way a tensor
reaches the host (item, float, bool, tolist, device synchronize) counted."""

from __future__ import annotations

import contextlib
import traceback
from collections import Counter

import numpy as np
import torch

from pipeline import config, distributed

TINY = "configs/tiny_prism.yaml"


class FakeLoader:
    """The ShardLoader interface train_step uses, over random tokens."""

    def __init__(self, batch: int, seq_len: int, vocab: int):
        self.rng = np.random.default_rng(0)
        self.shape, self.vocab, self.served = (batch, seq_len + 1), vocab, 0

    def next_batch(self) -> np.ndarray:
        self.served += 1
        return self.rng.integers(0, self.vocab, self.shape, dtype=np.int64)

    def state_dict(self) -> dict:
        return {"served": self.served}


@contextlib.contextmanager
def count_host_syncs():
    from deepspeed.accelerator import get_accelerator

    counts: Counter = Counter()
    sites: Counter = Counter()  # where they happen, for the failure message
    counts.sites = sites
    accel = get_accelerator()
    patched = [
        (torch.Tensor, name) for name in ("item", "__float__", "__bool__", "__int__", "tolist", "cpu", "numpy")
    ] + [(torch.cuda, "synchronize"), (type(accel), "synchronize")]
    saved = [(owner, name, getattr(owner, name)) for owner, name in patched]

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            where = traceback.extract_stack()[-2]
            sites[f"{name} {where.filename.split('site-packages/')[-1]}:{where.lineno}"] += 1
            return fn(*args, **kwargs)

        return wrapper

    for owner, name, fn in saved:
        setattr(owner, name, counting(name, fn))
    try:
        yield counts
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def test_deepspeed_steps_do_not_sync_until_read_back(monkeypatch):
    from pipeline import train
    from pipeline.model import build_model
    from pipeline.train import build_engine, deepspeed_config, train_step

    # as on a GPU: bf16 and the fused AdamW make_optimizer picks on CUDA (torch has it on CPU too)
    monkeypatch.setattr(train, "adamw_implementation", lambda device: {"fused": True})
    cfg = config.load(
        TINY, ["model.seq_len=32", "train.batch_tokens=256", "train.micro_batch_size=4", "train.precision=bf16"]
    )
    assert deepspeed_config(cfg, 2, 1)["timers"] == {"throughput": {"enabled": False}}
    distributed.init_model_parallel(1, cfg.run.seed)
    engine, optimizer = build_engine(cfg, build_model(cfg), grad_accum=2, dp_size=1)
    # bf16 + fp32 grad accumulation under ZeRO-1: DeepSpeed's BF16_Optimizer replaced each param group by one
    # flat fp32 partition, so the fused AdamW steps 2 tensors in all
    stepped = train.optimizer_stepped(engine, optimizer)
    assert stepped == "BF16_Optimizer -> torch AdamW (fused) over [1, 1] tensors per param group"
    loader = FakeLoader(4, 32, cfg.model.vocab_size)
    train_step(engine, optimizer, loader, 1e-3, 2, "cpu").read_back()  # first step: lazy allocations
    with count_host_syncs() as counts:
        results = [train_step(engine, optimizer, loader, 1e-3, 2, "cpu") for _ in range(3)]
    assert loader.served == 8 and engine.global_steps == 4  # really stepped
    # Left: DeepSpeed 0.19.8's BF16_Optimizer.step reads two bools per step: `if is_invalid_grad_norm(norm)`
    # (skip a NaN step) and `if clip_coef < 1` in clip_tensors_by_global_norm. Nothing of ours syncs.
    deepspeed_own = {"__bool__ deepspeed/runtime/utils.py:233", "__bool__ deepspeed/runtime/utils.py:988"}
    assert set(counts.sites) <= deepspeed_own, f"host syncs on non-sync steps: {dict(counts.sites)}"
    with count_host_syncs() as counts:
        values = [r.read_back() for r in results]
    assert counts["tolist"] == 3  # the read-back is the one sync per step, and the counter sees it
    assert all(np.isfinite(r.loss) and r.grad_norm > 0 for r in values)


def test_adamw_kernels_by_device():
    from pipeline.train import adamw_implementation

    assert adamw_implementation("cuda") == {"fused": True}
    assert adamw_implementation("cpu") == {"foreach": False}  # bit-identical to earlier CPU runs

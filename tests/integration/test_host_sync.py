"""No host sync outside sync steps: real DeepSpeed (ZeRO-1) steps of the trainer, with every way a tensor
reaches the host (item, float, bool, tolist, device synchronize) counted."""

from __future__ import annotations

import contextlib
import traceback
from collections import Counter, deque

import numpy as np
import pytest
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


def build_tiny_engine(overrides: list[str], model_state: dict | None = None, skipper=None):
    """The trainer's engine on the tiny model (bf16 unless overridden), optionally from given weights."""
    from pipeline.model import build_model
    from pipeline.train.engine import build_engine

    cfg = config.load(
        TINY,
        ["model.seq_len=32", "train.batch_tokens=256", "train.micro_batch_size=4", "train.precision=bf16"] + overrides,
    )
    distributed.init_model_parallel(1, cfg.run.seed)
    model = build_model(cfg)
    if model_state is not None:
        model.load_state_dict(model_state)
    engine, optimizer = build_engine(cfg, model, grad_accum=2, dp_size=1, skipper=skipper)
    return cfg, engine, optimizer


def all_weights(engine, optimizer) -> list[torch.Tensor]:
    """The bf16 module weights and the fp32 master partitions the torch optimizer steps."""
    return [p.detach().clone() for p in engine.module.parameters()] + [
        p.detach().clone() for group in optimizer.param_groups for p in group["params"]
    ]


# ZeRO-1 bf16 (the study's presets) runs DeepSpeed's BF16_Optimizer, ZeRO-2 bf16 its DeepSpeedZeroOptimizer
WRAPPERS = {1: "BF16_Optimizer", 2: "DeepSpeedZeroOptimizer"}


@pytest.mark.parametrize("zero_stage", [1, 2])
def test_deepspeed_steps_do_not_sync_until_read_back(zero_stage):
    from pipeline.skipping import StepSkipper
    from pipeline.train.engine import deepspeed_config, optimizer_stepped, train_step

    skipper = StepSkipper(4, 6.0, "cpu")  # as the trainer steps: every step asks whether to skip
    cfg, engine, optimizer = build_tiny_engine([f"parallel.zero_stage={zero_stage}"], skipper=skipper)
    assert deepspeed_config(cfg, 2, 1)["timers"] == {"throughput": {"enabled": False}}
    # DeepSpeed replaced each param group by one flat fp32 partition, so the fused AdamW steps 2 tensors in all
    stepped = optimizer_stepped(engine, optimizer)
    assert stepped == f"{WRAPPERS[zero_stage]} -> torch AdamW (fused) over [1, 1] tensors per param group"
    loader = FakeLoader(4, 32, cfg.model.vocab_size)
    train_step(engine, optimizer, loader, 1e-3, 2, "cpu", skipper).read_back()  # first step: lazy allocations
    with count_host_syncs() as counts:
        results = [train_step(engine, optimizer, loader, 1e-3, 2, "cpu", skipper) for _ in range(3)]
    assert loader.served == 8 and engine.global_steps == 4  # really stepped
    # DeepSpeed 0.19.8's own step reads the grad norm on the host (`if is_invalid_grad_norm(norm)`, `if clip_coef
    # < 1`): compat.remove_host_syncs replaces those reads, so nothing syncs, ours or DeepSpeed's
    assert not counts.sites, f"host syncs on non-sync steps: {dict(counts.sites)}"
    with count_host_syncs() as counts:
        values = [r.read_back() for r in results]
    assert counts["tolist"] == 3  # the read-back is the one sync per step, and the counter sees it
    assert all(np.isfinite(r.loss) and r.grad_norm > 0 for r in values)
    assert [r.skipped for r in values] == [0, 0, 0]


@pytest.mark.parametrize("zero_stage", [1, 2])
@pytest.mark.parametrize("grad_clip", [1e-3, 1e6])  # clipping engaged (norm >> 1e-3) and not (norm << 1e6)
def test_sync_free_step_updates_like_deepspeeds_own(monkeypatch, caplog, zero_stage, grad_clip):
    from pipeline import compat
    from pipeline.train.engine import train_step

    overrides = [f"parallel.zero_stage={zero_stage}", f"train.grad_clip={grad_clip}"]
    deepspeed = compat.import_deepspeed()
    with monkeypatch.context() as m, caplog.at_level("WARNING", logger="pipeline.compat.deepspeed"):
        # another DeepSpeed release than the copy mirrors: its own step runs, with one warning line
        m.setattr(deepspeed, "__version__", "0.19.9")
        m.setattr(compat.deepspeed, "_WARNED_FALLBACK", False)
        cfg, engine, optimizer = build_tiny_engine(overrides)
    fallback = [r.getMessage() for r in caplog.records if r.name == "pipeline.compat.deepspeed"]
    assert len(fallback) == 1 and fallback[0].startswith("prism: warning: DeepSpeed 0.19.9 is installed"), fallback
    model_state = {k: v.clone() if torch.is_tensor(v) else v for k, v in engine.module.state_dict().items()}
    sync_free = build_tiny_engine(overrides, model_state)[1:]
    assert "step" not in vars(engine.optimizer) and "unscale_and_clip_grads" not in vars(engine.optimizer)
    assert {"step", "unscale_and_clip_grads"} & set(vars(sync_free[0].optimizer))  # really patched
    assert all(torch.equal(a, b) for a, b in zip(all_weights(engine, optimizer), all_weights(*sync_free)))

    norms = {}
    for name, (eng, opt) in {"deepspeed": (engine, optimizer), "sync_free": sync_free}.items():
        loader = FakeLoader(4, 32, cfg.model.vocab_size)  # the same batches for both
        results = [train_step(eng, opt, loader, 1e-2, 2, "cpu").read_back() for _ in range(3)]
        norms[name] = [r.grad_norm for r in results]
    assert norms["sync_free"] == norms["deepspeed"]
    assert all((n > grad_clip) == (grad_clip < 1) for n in norms["deepspeed"])  # clipped iff meant to be
    # Exactly equal: the same clip coefficient (DeepSpeed's formula), and a factor of exactly 1.0 when not clipping
    pairs = zip(all_weights(engine, optimizer), all_weights(*sync_free), strict=True)
    mismatched = [i for i, (a, b) in enumerate(pairs) if not torch.equal(a, b)]
    assert not mismatched, f"weights {mismatched} differ from DeepSpeed's own step's"


@pytest.mark.parametrize("zero_stage", [1, 2])
def test_nonfinite_step_reads_back_inf_and_keeps_weights_finite(zero_stage):
    from pipeline.train.diagnostics import UnreadSteps
    from pipeline.train.engine import train_step

    cfg, engine, optimizer = build_tiny_engine([f"parallel.zero_stage={zero_stage}"])
    loader = FakeLoader(4, 32, cfg.model.vocab_size)
    unread = UnreadSteps()
    unread.add(1, train_step(engine, optimizer, loader, 1e-3, 2, "cpu"))
    with count_host_syncs() as counts:  # no skipper: DeepSpeed's clipping alone must keep the weights finite
        unread.add(2, train_step(engine, optimizer, loader, 1e-3, 2, "cpu", None, 0.0, float("nan")))
    assert not counts.sites, f"host syncs on a non-finite step: {dict(counts.sites)}"
    unread.add(3, train_step(engine, optimizer, loader, 1e-3, 2, "cpu"))
    # the trainer's read-back finds the NaN step (and stops with exit 4), its grad norm inf
    step, bad = unread.read_back(deque())
    assert step == 2 and np.isnan(bad.loss) and bad.grad_norm == float("inf")
    assert all(torch.isfinite(w).all() for w in all_weights(engine, optimizer)), "a NaN step poisoned the weights"
    later = train_step(engine, optimizer, loader, 1e-3, 2, "cpu").read_back()
    assert np.isfinite(later.loss) and np.isfinite(later.grad_norm)


def test_sync_free_steps_refuse_a_deepspeed_without_what_they_mirror():
    from types import SimpleNamespace

    from pipeline import compat

    changed = SimpleNamespace(clip_grad=1.0)  # e.g. an upgrade renamed the rest
    with pytest.raises(RuntimeError, match=r"pipeline/compat/deepspeed.py sync_free_bf16_step: .*re-mirror"):
        compat.sync_free_bf16_step(changed)
    with pytest.raises(RuntimeError, match=r"pipeline/compat/deepspeed.py zero_clip_without_host_reads: .*re-mirror"):
        compat.zero_clip_without_host_reads(changed)
    assert "step" not in vars(changed)


def optimizer_state(engine, optimizer) -> list[torch.Tensor]:
    """Every weight copy (bf16 module, fp32 partitions) and the AdamW moments and step counts."""
    return all_weights(engine, optimizer) + [
        v.detach().clone() for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)
    ]


@pytest.mark.parametrize(
    "precision, zero_stage",
    # DeepSpeed's BF16_Optimizer (ZeRO-1 bf16), its ZeRO optimizer in bf16, and in fp32 (where DeepSpeed skips
    # a NaN norm itself, on the host)
    [("bf16", 1), ("bf16", 2), ("fp32", 1)],
)
def test_a_nan_or_spiking_step_is_skipped_with_weights_and_optimizer_state_unchanged(
    monkeypatch, precision, zero_stage
):
    from pipeline.skipping import StepSkipper
    from pipeline.train.diagnostics import UnreadSteps
    from pipeline.train.engine import train_step

    skipper = StepSkipper(4, 6.0, "cpu")  # the spike test is on from 2 steps
    overrides = [f"parallel.zero_stage={zero_stage}", f"train.precision={precision}"]
    cfg, engine, optimizer = build_tiny_engine(overrides, skipper=skipper)
    loader = FakeLoader(4, 32, cfg.model.vocab_size)
    unread = UnreadSteps(max_skips_in_a_row=3)

    def step(n, fault=None):
        unread.add(n, train_step(engine, optimizer, loader, 1e-3, 2, "cpu", skipper, 0.0, fault))

    for n in (1, 2, 3):
        step(n)
    before = optimizer_state(engine, optimizer)
    with count_host_syncs() as counts:
        step(4, float("nan"))  # NaN loss and gradients
        step(5, 1e3)  # a spike: loss and grad norm x 1000
    assert not counts.sites or precision == "fp32", f"host syncs on skipped steps: {dict(counts.sites)}"
    after = optimizer_state(engine, optimizer)
    assert len(after) == len(before) > 4  # weights, moments and step counts are all there
    changed = [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if not torch.equal(a, b)]
    assert not changed, f"a skipped step changed tensors {changed}"
    step(6)
    assert unread.read_back(deque()) is None  # two skips in a row: below 3, the run goes on
    assert [s for s, _ in unread.skipped] == [4, 5]
    assert unread.skipped[-1][1].skipped_total == 2 and int(skipper.total) == 2 and int(skipper.in_a_row) == 0
    assert not torch.equal(optimizer_state(engine, optimizer)[0], after[0])  # step 6 trained
    for n in (7, 8, 9):
        step(n, float("nan"))
    stop, result = unread.read_back(deque())  # the third NaN in a row ends the run
    assert stop == 9 and result.skips_in_a_row == 3 and result.skipped_total == 5

"""Trainer pieces in one process: the LR schedule, the AdamW parameter groups, the train state's round trip
(counters, loader position, every RNG) and how `latest` resolves checkpoint folders."""

from __future__ import annotations

import pytest

from pipeline import config
from pipeline.config import ConfigError

PRESET = "configs/tiny_prism.yaml"


def test_lr_schedule_values():
    from pipeline.lr_schedule import lr_at

    lr, low = 1e-3, 1e-4
    assert lr_at(0, 100, 10, lr, low) == pytest.approx(1e-4)  # first step is not 0
    assert lr_at(4, 100, 10, lr, low) == pytest.approx(5e-4)
    assert lr_at(9, 100, 10, lr, low) == pytest.approx(lr)
    assert lr_at(10, 100, 10, lr, low) == pytest.approx(lr)  # cosine starts at the peak
    assert lr_at(55, 100, 10, lr, low) == pytest.approx((lr + low) / 2)  # half-way through the decay
    assert lr_at(100, 100, 10, lr, low) == pytest.approx(low)
    values = [lr_at(s, 100, 10, lr, low) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(values, values[1:])) and min(values) >= low
    assert lr_at(0, 5, 0, lr, low) == pytest.approx(lr)  # no warmup


def test_weight_decay_groups_follow_nanogpt_embedding_decays_norms_do_not():
    import torch

    from pipeline import distributed
    from pipeline.model import build_model
    from pipeline.train.engine import make_optimizer

    cfg = config.load(
        PRESET, ["model.num_layers=4", "model.h_base=4", "schedule.heads=2x2,4x2", "train.precision=fp32"]
    )
    distributed.init_model_parallel(1, cfg.run.seed)
    model = build_model(cfg)
    opt = make_optimizer(cfg, model)
    names = {id(p): n for n, p in model.named_parameters()}
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == cfg.train.weight_decay > 0 and no_decay["weight_decay"] == 0.0
    assert (decay["betas"], decay["eps"]) == ((cfg.train.beta1, cfg.train.beta2), cfg.train.eps)
    decayed = {names[id(p)] for p in decay["params"]}
    kept = {names[id(p)] for p in no_decay["params"]}
    assert decayed | kept == set(names.values()) and not decayed & kept
    # nanoGPT: every >= 2-dim parameter decays, the tied token embedding (= the output layer) included
    assert "embedding.word_embeddings.weight" in decayed and cfg.model.tie_embeddings
    assert decayed == {n for n in names.values() if model.get_parameter(n).ndim >= 2}
    assert kept and all(("norm" in n or n.endswith("bias")) and model.get_parameter(n).ndim == 1 for n in kept)
    assert any("linear_qkv.weight" in n for n in decayed) and any("linear_fc2.weight" in n for n in decayed)
    # What the groups do: with zero gradients AdamW's update is 0 and only its decoupled decay moves a weight,
    # by exactly p * lr * wd for the decayed group; the others stay put (an L2-style Adam would move them all).
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    shrink = 1 - cfg.train.lr * cfg.train.weight_decay
    for n, p in model.named_parameters():
        want = before[n] * shrink if n in decayed else before[n]
        assert torch.equal(p.detach(), want), n
    assert all(not torch.equal(model.get_parameter(n).detach(), before[n]) for n in decayed)


@pytest.mark.megatron_compat
def test_train_state_round_trip_restores_counters_loader_and_every_rng():
    import pickle
    import random

    import numpy as np
    import torch
    from megatron.core import tensor_parallel

    from pipeline import distributed
    from pipeline.checkpoint.restore import TrainState

    class Loader:
        def __init__(self, position: dict) -> None:
            self.position = position

        def state_dict(self) -> dict:
            return dict(self.position)

        def load_state_dict(self, state: dict) -> None:
            self.position = dict(state)

    def draws() -> tuple:
        with tensor_parallel.get_cuda_rng_tracker().fork():  # the TP-region dropout stream
            tp_region = torch.rand(3).tolist()
        return random.random(), float(np.random.rand()), torch.rand(3).tolist(), tp_region

    distributed.init_model_parallel(1, seed=5)
    saved = TrainState(step=7, tokens_seen=7 * 1024, run_id="run-abc", loader=Loader({"shard": 3, "row": 11}))
    # pickled, as the checkpoint's gather across ranks and torch.save do
    state = pickle.loads(pickle.dumps(saved.state_dict()))
    expected = draws()
    assert draws() != expected  # every generator moved on
    restored = TrainState(loader=Loader({"shard": 0, "row": 0}))
    restored.load_state_dict(state)
    assert (restored.step, restored.tokens_seen, restored.run_id) == (7, 7 * 1024, "run-abc")
    assert restored.loader.position == {"shard": 3, "row": 11}
    assert draws() == expected


def test_latest_resolves_tag_checkpoint_and_run_folders_through_one_function(tmp_path):
    from pipeline.checkpoint import latest_tag, resolve_tag_dir

    run_dir = tmp_path / "run"
    ckpt = run_dir / "checkpoints"
    for tag in ("step-0000003", "step-0000006"):
        (ckpt / tag).mkdir(parents=True)
        (ckpt / tag / "config.yaml").write_text("{}\n")
    assert latest_tag(ckpt) is None
    with pytest.raises(ConfigError, match="neither a checkpoint tag folder"):
        resolve_tag_dir(run_dir)
    (ckpt / "latest").write_text("step-0000003\n")
    assert latest_tag(ckpt) == "step-0000003"
    assert resolve_tag_dir(ckpt / "step-0000006") == ckpt / "step-0000006"  # a tag folder names itself
    assert resolve_tag_dir(ckpt) == ckpt / "step-0000003"
    assert resolve_tag_dir(run_dir) == ckpt / "step-0000003"
    (ckpt / "latest").write_text("step-0000009")
    # the trainer's resume and the readers refuse a dangling pointer with the same line
    for read in (lambda: latest_tag(ckpt), lambda: resolve_tag_dir(run_dir)):
        with pytest.raises(ConfigError, match=r"latest: names tag 'step-0000009', which does not exist"):
            read()
    with pytest.raises(ConfigError, match="checkpoint not found"):
        resolve_tag_dir(tmp_path / "missing")


def test_readers_refuse_truncated_weights_named_by_the_integrity_record(tmp_path):
    import json

    from pipeline.checkpoint import INTEGRITY, MODEL_STATES, read_weights

    tag = tmp_path / "step-0000003"
    tag.mkdir()
    (tag / MODEL_STATES).write_bytes(b"x" * 10)
    (tag / INTEGRITY).write_text(json.dumps({"files": {MODEL_STATES: {"size": 20, "sha256": "0"}}}))
    with pytest.raises(ConfigError, match=r"has 10 bytes, its integrity record says 20 \(truncated\)"):
        read_weights(tag)


def test_step_actions_by_hand():
    """Which steps validate, log, checkpoint and so sync: log every 2, validate every 3, checkpoint every 4,
    7 steps; the first step logs, the last does everything, a stop signal checkpoints (and so syncs)."""
    from pipeline import config
    from pipeline.cadence import step_actions

    cfg = config.load("configs/tiny_prism.yaml", ["train.log_every=2", "train.val_every=3", "checkpoint.every_steps=4"])
    actions = {step: step_actions(cfg, step, 7) for step in range(1, 8)}
    assert [s for s, a in actions.items() if a.validate] == [3, 6, 7]
    assert [s for s, a in actions.items() if a.log] == [1, 2, 3, 4, 6, 7]  # a validation step logs its val loss
    assert [s for s, a in actions.items() if a.checkpoint] == [4, 7]
    assert [s for s, a in actions.items() if a.sync] == [1, 2, 3, 4, 6, 7]
    assert step_actions(cfg, 5, 7, stop=True).checkpoint and step_actions(cfg, 5, 7, stop=True).sync
    assert not step_actions(cfg, 5, 7, stop=True).validate


def test_step_actions_with_a_checkpoint_clock():
    """checkpoint.every_minutes replaces every_steps: a step checkpoints when the ranks' clock reading says
    every_minutes have passed since the last save, read at sync steps that save for no other reason only (a
    collective in the loop); also at the last step and on a stop signal."""
    from pipeline import config
    from pipeline.cadence import step_actions

    cfg = config.load("configs/tiny_prism.yaml", ["train.log_every=2", "checkpoint.every_minutes=30"])
    assert not any(step_actions(cfg, step, 9).checkpoint for step in range(1, 9))
    assert step_actions(cfg, 9, 9).checkpoint and step_actions(cfg, 3, 9, stop=True).checkpoint
    read = []

    def clock(seconds):
        return lambda: read.append(seconds) or seconds

    due = step_actions(cfg, 4, 9, since_save=clock(30 * 60))
    assert due.checkpoint and due.sync and read == [1800]
    assert not step_actions(cfg, 4, 9, since_save=clock(30 * 60 - 1)).checkpoint
    step_actions(cfg, 3, 9, since_save=clock(1e9))  # not a sync step: the clock is not read
    step_actions(cfg, 9, 9, since_save=clock(1e9))  # the last step saves anyway: not read either
    assert read == [1800, 1799]
    by_steps = config.load("configs/tiny_prism.yaml", ["train.log_every=2", "checkpoint.every_steps=4"])
    assert not step_actions(by_steps, 2, 9, since_save=clock(1e9)).checkpoint and read == [1800, 1799]


def test_staged_checkpoint_files_are_host_copies_taken_at_save_time():
    """What DeepSpeed hands the staging engine aliases live tensors: the staged copy must not move when
    training changes them, a tensor referenced twice (tied weights) stays one tensor, and the host buffers
    are reused by the next save (one save in flight at a time)."""
    import torch

    from pipeline.compat import StagingCheckpointEngine

    class Inner:
        zipfile_serialization = True

        def load(self, path, map_location=None):
            return "inner load"

    engine = StagingCheckpointEngine(Inner())
    weight, moment = torch.arange(6.0).view(2, 3), torch.ones(4)
    state = {"module": {"a": weight, "tied": weight}, "optim": [{"exp_avg": moment, "step": 3}], "shape": (2, 3)}
    engine.save(state, "/x/step-1/mp_rank_00_model_states.pt")
    [(path, staged)] = engine.take_staged()
    weight.add_(100.0)
    moment.zero_()
    assert path.endswith("mp_rank_00_model_states.pt") and staged["shape"] == (2, 3)
    assert torch.equal(staged["module"]["a"], torch.arange(6.0).view(2, 3))
    assert staged["module"]["a"] is staged["module"]["tied"] and torch.equal(
        staged["optim"][0]["exp_avg"], torch.ones(4)
    )
    assert staged["optim"][0]["step"] == 3 and engine.load("p") == "inner load"
    engine.save(state, "/x/step-2/mp_rank_00_model_states.pt")
    [(_, again)] = engine.take_staged()
    assert again["module"]["a"].data_ptr() == staged["module"]["a"].data_ptr()  # the same host buffer
    assert torch.equal(again["module"]["a"], weight)


def test_step_actions_evals_at_multiples_of_eval_every_and_the_last_step():
    """Downstream evals: every eval_every steps and at the last; each one a sync step; none with eval_every=0."""
    from pipeline import config
    from pipeline.cadence import step_actions

    cfg = config.load("configs/tiny_prism.yaml", ["train.log_every=5", "train.val_every=5", "train.eval_every=3"])
    actions = {step: step_actions(cfg, step, 7) for step in range(1, 8)}
    assert [s for s, a in actions.items() if a.eval] == [3, 6, 7]
    assert all(a.sync for a in actions.values() if a.eval)
    assert [s for s, a in actions.items() if a.sync] == [1, 3, 5, 6, 7]
    off = config.load("configs/tiny_prism.yaml", ["train.eval_every=0"])
    assert not any(step_actions(off, step, 7).eval for step in range(1, 8))


def test_rng_preserved_leaves_the_training_streams_as_they_were():
    """lm-eval reseeds python, numpy and torch: inside rng_preserved that does not reach the training draws."""
    import random

    import numpy as np
    import torch

    from pipeline import distributed
    from pipeline.checkpoint.restore import rng_preserved

    distributed.init_model_parallel(tp=1, seed=5)
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    with rng_preserved():
        random.seed(0), np.random.seed(1234), torch.manual_seed(1234)
        torch.rand(5), np.random.rand(3), random.random()
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected

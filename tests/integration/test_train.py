"""The trainer with real DeepSpeed engines in real processes (gloo on CPU, torchrun for 2 ranks).

Runs are shared between assertions: one uninterrupted TP=1 run is the reference for exact resume, for TP=2
and (through an in-process plain-PyTorch loop over the same global batch) for DP=2.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from pipeline import checkpoint, config
from pipeline.config import ConfigError

ROOT = Path(__file__).resolve().parent.parent
PRESET = ROOT / "configs" / "tiny_prism.yaml"
STEPS, CKPT_EVERY = 6, 3
# 4 layers, 2 x 128 tokens per micro-batch, 1024 tokens per step: grad accumulation 4 at DP=1, 2 at DP=2.
SMALL = [
    "model.num_layers=4",
    "schedule.heads=2x2,4x2",
    "train.batch_tokens=1024",
    "train.micro_batch_size=2",
    f"train.train_tokens={STEPS * 1024}",
    "train.warmup_fraction=0.34",
    "tracking.enabled=false",
    "train.log_every=1",
    "train.val_every=3",
    "train.val_tokens=1024",
    f"checkpoint.every_steps={CKPT_EVERY}",
    "checkpoint.keep_last=2",
    "train.precision=fp32",
]


def overrides(tiny_data, out: Path, *extra: str) -> list[str]:
    return [*tiny_data.overrides, *SMALL, f"run.output_dir={out}", *extra]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(ov: list[str], nproc: int) -> list[str]:
    train = ["-m", "pipeline.cli", "train", str(PRESET), *ov]
    if nproc == 1:
        return [sys.executable, *train]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        *train,
    ]


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def run(ov: list[str], nproc: int = 1) -> subprocess.CompletedProcess:
    out = subprocess.run(command(ov, nproc), cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"prism train failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def checkpoint_dir(out: Path) -> Path:
    return out / "prism-tiny-s1234" / "checkpoints"


def metrics(out: Path) -> dict[int, dict]:
    """step -> metrics; a step logged twice (before a kill and after the resume) keeps the later entry."""
    rows = [json.loads(line) for line in (checkpoint_dir(out) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows}


def kill_after_checkpoint(ov: list[str], nproc: int, out: Path) -> None:
    """Start a run, SIGKILL all its processes as soon as the first checkpoint is complete."""
    latest = checkpoint_dir(out) / "latest"
    proc = subprocess.Popen(
        command(ov, nproc), cwd=ROOT, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    deadline = time.time() + 240
    while not latest.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    # torchrun starts each worker in its own session: kill the agent and every descendant, by pid.
    for p in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    _, err = proc.communicate(timeout=60)
    assert latest.read_text() == f"step-{CKPT_EVERY:07d}", err[-3000:]
    assert max(metrics(out)) < STEPS, "the run finished before it could be killed"


def losses(m: dict[int, dict], key: str = "train/loss") -> list[float]:
    return [m[s][key] for s in range(1, STEPS + 1)]


@pytest.fixture(scope="module")
def reference(tiny_data, tmp_path_factory):
    """One uninterrupted single-process TP=1 ZeRO-1 run."""
    out = tmp_path_factory.mktemp("ref")
    log = run(overrides(tiny_data, out))
    return out, metrics(out), log.stdout


# --- unit: schedule and optimizer groups ----------------------------------------------------------------
def test_lr_schedule_values():
    from pipeline.train import lr_at

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


def test_weight_decay_groups_exclude_norms_and_embeddings(tiny_data):
    import torch

    from pipeline import distributed
    from pipeline.model import build_model
    from pipeline.train import make_optimizer

    cfg = config.load(PRESET, [*tiny_data.overrides, *SMALL])
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
    assert any("word_embeddings" in n for n in kept) and not any("embedding" in n for n in decayed)
    assert any("norm" in n for n in kept) and all(model.get_parameter(n).ndim >= 2 for n in decayed)
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


def test_train_state_round_trip_restores_counters_loader_and_every_rng():
    import pickle
    import random

    import numpy as np
    import torch
    from megatron.core import tensor_parallel

    from pipeline import distributed
    from pipeline.checkpoint import TrainState

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


# --- real runs ------------------------------------------------------------------------------------------
def test_single_process_trains_logs_and_checkpoints(reference):
    out, m, stdout = reference
    assert sorted(m) == list(range(1, STEPS + 1))
    first, last = m[1], m[STEPS]
    assert last["train/loss"] < first["train/loss"] and math.isfinite(last["val/loss"])
    assert "val/loss" in m[3] and "val/loss" not in m[2]
    for key in ("lr", "grad_norm", "tokens_per_sec", "step_time", "tokens_seen", "memory_gb"):
        assert key in last
    assert last["tokens_seen"] == STEPS * 1024
    assert "step      6/6 | tokens 6,144 | loss" in stdout and "| val " in stdout
    ckpt = checkpoint_dir(out)
    assert (ckpt / "latest").read_text() == f"step-{STEPS:07d}"
    assert sorted(p.name for p in ckpt.glob("step-*")) == [f"step-{CKPT_EVERY:07d}", f"step-{STEPS:07d}"]
    files = {p.name for p in (ckpt / f"step-{STEPS:07d}").iterdir()}
    assert {"mp_rank_00_model_states.pt", "config.yaml"} <= files and any("optim_states" in f for f in files)
    # readers get the weights and the train state's facts through pipeline.checkpoint, from the run folder
    weights, info = checkpoint.read_weights(checkpoint.resolve_tag_dir(ckpt.parent))
    assert info.tag_dir == ckpt / f"step-{STEPS:07d}" and info.step == STEPS and info.run_id is None
    assert info.client_state["tokens_seen"] == STEPS * 1024
    assert "embedding.word_embeddings.weight" in weights and not any(k.startswith("module.") for k in weights)


def test_exact_resume_after_sigkill_tp1_zero1(reference, tiny_data, tmp_path):
    _, ref, _ = reference
    ov = overrides(tiny_data, tmp_path)
    kill_after_checkpoint(ov, 1, tmp_path)
    log = run(ov)
    assert f"resumed from step-{CKPT_EVERY:07d}" in log.stdout
    got = metrics(tmp_path)
    for step in range(CKPT_EVERY + 1, STEPS + 1):  # bit-identical, not approximately equal
        assert got[step]["train/loss"] == ref[step]["train/loss"], step
        assert got[step]["grad_norm"] == ref[step]["grad_norm"], step
    assert got[STEPS]["val/loss"] == ref[STEPS]["val/loss"]


def test_resume_refused_after_model_change(reference, tiny_data):
    from pipeline.train import train

    out, _, _ = reference
    cfg = config.load(PRESET, [*overrides(tiny_data, out), "model.ffn_hidden_size=512"])
    with pytest.raises(ConfigError, match=r"cannot resume, model\.ffn_hidden_size changed \(688 -> 512\)"):
        train(cfg)


def test_signal_checkpoints_at_step_boundary_and_exits_3(reference, tiny_data, tmp_path):
    _, ref, _ = reference
    ov = overrides(tiny_data, tmp_path, "checkpoint.every_steps=100")
    proc = subprocess.Popen(
        command(ov, 1), cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    jsonl = checkpoint_dir(tmp_path) / "metrics.jsonl"
    while not jsonl.exists() and proc.poll() is None:
        time.sleep(0.02)
    proc.send_signal(signal.SIGUSR1)
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 3, stderr[-3000:]
    stopped = max(metrics(tmp_path))
    assert stopped < STEPS and "stop signal received" in stdout
    assert (checkpoint_dir(tmp_path) / "latest").read_text() == f"step-{stopped:07d}"
    run(ov)
    got = metrics(tmp_path)
    assert [got[s]["train/loss"] for s in range(stopped + 1, STEPS + 1)] == [
        ref[s]["train/loss"] for s in range(stopped + 1, STEPS + 1)
    ]


def test_tp2_zero2_matches_tp1_and_resumes_exactly(reference, tiny_data, tmp_path):
    _, ref, _ = reference
    tp2 = ["parallel.tp=2", "parallel.zero_stage=2"]
    full = tmp_path / "full"
    run(overrides(tiny_data, full, *tp2), nproc=2)
    m = metrics(full)
    # Same data and math as TP=1: step 1 (same weights) agrees to fp32 reduction order; a missing mpu shows
    # up there as a ~40 % different grad norm. Later steps drift by summation order only.
    assert (m[1]["train/loss"], m[1]["grad_norm"]) == pytest.approx(
        (ref[1]["train/loss"], ref[1]["grad_norm"]), rel=1e-5
    )
    assert losses(m) == pytest.approx(losses(ref), rel=2e-3)
    assert losses(m, "grad_norm") == pytest.approx(losses(ref, "grad_norm"), rel=2e-3)
    killed = tmp_path / "killed"
    ov = overrides(tiny_data, killed, *tp2)
    kill_after_checkpoint(ov, 2, killed)
    run(ov, nproc=2)
    got = metrics(killed)
    for step in range(CKPT_EVERY + 1, STEPS + 1):
        assert (got[step]["train/loss"], got[step]["grad_norm"]) == (
            m[step]["train/loss"],
            m[step]["grad_norm"],
        )


def reference_loop(cfg: config.Config, dp_size: int, steps: int) -> tuple[list[float], list[float]]:
    """Plain PyTorch on one process over the same global batch a DP run sees: the batches of every DP rank's
    loader, summed gradients, torch's clip_grad_norm_ and the same AdamW groups and LR schedule."""
    import torch

    from pipeline import data, distributed
    from pipeline.model import build_model, lm_loss
    from pipeline.train import lr_at, make_optimizer

    distributed.init_model_parallel(1, cfg.run.seed)
    model = build_model(cfg)
    opt = make_optimizer(cfg, model)
    plan = cfg.steps(dp_size)
    loaders = [
        data.ShardLoader(cfg, dp_rank=r, dp_size=dp_size, batch_size=cfg.train.micro_batch_size) for r in range(dp_size)
    ]
    step_losses, norms = [], []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, plan["total"], plan["warmup"], cfg.train.lr, cfg.train.min_lr)
        micro = []
        for _ in range(plan["grad_accum"]):
            for loader in loaders:
                loss = lm_loss(model, torch.from_numpy(loader.next_batch()))
                (loss / (plan["grad_accum"] * dp_size)).backward()
                micro.append(loss.item())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        step_losses.append(sum(micro) / len(micro))
    for loader in loaders:
        loader.close()
    return step_losses, norms


def test_dp2_zero2_matches_single_process_on_the_same_global_batch(tiny_data, tmp_path):
    ov = overrides(tiny_data, tmp_path, "parallel.zero_stage=2")
    run(ov, nproc=2)
    m = metrics(tmp_path)
    want_loss, want_norm = reference_loop(config.load(PRESET, ov), dp_size=2, steps=3)
    # step 1: same weights, same global batch; only the reduction order differs (a wrong DP averaging or
    # an unsplit batch would be off by far more)
    assert (m[1]["train/loss"], m[1]["grad_norm"]) == pytest.approx((want_loss[0], want_norm[0]), rel=2e-4)
    assert losses(m)[:3] == pytest.approx(want_loss, rel=2e-3)
    assert losses(m, "grad_norm")[:3] == pytest.approx(want_norm, rel=2e-3)


def test_nonfinite_loss_stops_with_exit_4_and_keeps_the_last_good_checkpoint(tiny_data, tmp_path):
    # lr 1e4 explodes the weights after the first update: step 2's loss is NaN
    ov = overrides(tiny_data, tmp_path, "train.lr=1e4", "train.min_lr=0", "checkpoint.every_steps=1")
    out = subprocess.run(command(ov, 1), cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 4, out.stderr[-3000:]
    ckpt = checkpoint_dir(tmp_path)
    assert (ckpt / "latest").read_text() == "step-0000001"
    assert sorted(p.name for p in ckpt.glob("step-*")) == ["step-0000001"]  # nothing written after the NaN
    dump = json.loads((ckpt / "nonfinite-step-0000002-rank0.json").read_text())
    assert dump["step"] == 2 and dump["last_good_checkpoint"] == "step-0000001"
    assert not math.isfinite(dump["train_loss"]) or not math.isfinite(dump["grad_norm"])
    assert "prism train: error: non-finite loss" in out.stderr and (ckpt / "nonfinite-step-0000002-rank0.npz").exists()

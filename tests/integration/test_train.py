"""The trainer with real DeepSpeed engines in real processes (gloo on CPU, torchrun for 2 ranks).

Runs are shared between assertions: one uninterrupted TP=1 run is the reference for exact resume, for TP=2
and (through an in-process plain-PyTorch loop over the same global batch) for DP=2.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
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

ROOT = Path(__file__).resolve().parents[2]
PRESET = ROOT / "configs" / "tiny_prism.yaml"
STEPS, CKPT_EVERY = 6, 3
# 4 layers (6 heads of 32, then the tiny baseline 12 of 16: both split at TP=2), 2 x 128 tokens per
# micro-batch, 1024 tokens per step: grad accumulation 4 at DP=1, 2 at DP=2.
SMALL = [
    "model.num_layers=4",
    "schedule.heads=6x2,12x2",
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


def run(ov: list[str], nproc: int = 1, faults: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    out = subprocess.run(
        command(ov, nproc), cwd=ROOT, env={**env(), **(faults or {})}, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, f"prism train failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def checkpoint_dir(out: Path) -> Path:
    return out / "prism-tiny-s1234" / "checkpoints"


def validation_steps(out: Path) -> dict[str, list[int]]:
    """Per validation metric, the steps the journal logged it at, every entry (a repeated step shows twice)."""
    rows = [json.loads(line) for line in (checkpoint_dir(out) / "metrics.jsonl").read_text().splitlines()]
    return {m: [r["step"] for r in rows if m in r] for m in ("val/loss", "val/heldout/loss")}


def metrics(out: Path) -> dict[int, dict]:
    """step -> metrics, the step's rows joined (an eval logs a row of its own); a step logged twice (before a
    kill and after the resume) keeps the later values."""
    rows = [json.loads(line) for line in (checkpoint_dir(out) / "metrics.jsonl").read_text().splitlines()]
    joined: dict[int, dict] = {}
    for r in rows:
        joined.setdefault(r["step"], {}).update(r)
    return joined


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


# --- real runs ------------------------------------------------------------------------------------------
def test_train_refuses_a_dataset_built_with_another_tokenizer(tiny_data, tmp_path):
    """Another tokenizer file than the dataset's: refused by `prism train` itself, one line, exit 2."""
    other = tmp_path / "other-tokenizer.json"
    other.write_bytes(Path(tiny_data.tokenizer).read_bytes() + b" ")
    assert (
        hashlib.sha256(other.read_bytes()).digest() != hashlib.sha256(Path(tiny_data.tokenizer).read_bytes()).digest()
    )
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline.cli",
            "train",
            str(PRESET),
            *tiny_data.overrides,
            f"data.tokenizer={other}",
            f"run.output_dir={tmp_path / 'runs'}",
            "tracking.enabled=false",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    err_lines = [line for line in out.stderr.splitlines() if line.startswith("prism train: error:")]
    assert len(err_lines) == 1 and "different tokenizer" in err_lines[0] and str(other) in err_lines[0]


@pytest.mark.megatron_compat
def test_single_process_trains_logs_and_checkpoints(reference):
    out, m, stdout = reference
    assert sorted(m) == list(range(1, STEPS + 1))
    first, last = m[1], m[STEPS]
    assert last["train/loss"] < first["train/loss"] and math.isfinite(last["val/loss"])
    assert "val/loss" in m[3] and "val/loss" not in m[2]
    trained = ("train/lr", "train/grad_norm", "train/tokens_seen")
    for key in (*trained, "perf/train_tokens_per_sec", "perf/step_time", "perf/memory_gb"):
        assert key in last
    assert last["train/tokens_seen"] == STEPS * 1024
    assert {key.split("/")[0] for key in last if key not in ("step", "time")} <= {"train", "val", "perf", "data"}
    assert "step      6/6 | tokens 6,144 | loss" in stdout and "| val " in stdout
    assert re.search(r"\| [\d,]+ train tok/s \|", stdout)  # the rate perf/train_tokens_per_sec logs
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


@pytest.mark.megatron_compat
def test_exact_resume_after_sigkill_tp1_zero1(reference, tiny_data, tmp_path):
    _, ref, _ = reference
    ov = overrides(tiny_data, tmp_path)
    kill_after_checkpoint(ov, 1, tmp_path)
    log = run(ov)
    assert f"resumed from step-{CKPT_EVERY:07d}" in log.stdout
    got = metrics(tmp_path)
    for step in range(CKPT_EVERY + 1, STEPS + 1):  # bit-identical, not approximately equal
        assert got[step]["train/loss"] == ref[step]["train/loss"], step
        assert got[step]["train/grad_norm"] == ref[step]["train/grad_norm"], step
    assert got[STEPS]["val/loss"] == ref[STEPS]["val/loss"]


@pytest.mark.megatron_compat
def test_resume_refused_after_model_change(reference, tiny_data):
    from pipeline.train import train

    out, _, _ = reference
    cfg = config.load(PRESET, [*overrides(tiny_data, out), "model.ffn_hidden_size=384"])
    with pytest.raises(ConfigError, match=r"cannot resume, model\.ffn_hidden_size changed \(512 -> 384\)"):
        train(cfg)


@pytest.fixture(scope="module")
def watched_run(tiny_data, tmp_path_factory):
    """One in-process 7-step run (log every 2, validate every 3, checkpoint every 4) with spies on what the
    loop does at each step and on every tokenizer hash."""
    from pipeline import data, train
    from pipeline.checkpoint.writer import Saver

    seen = {"hashed": [], "sync": [], "validate": [], "log": [], "checkpoint": []}
    real = {"hash": data.sha256_file, "read_back": train.UnreadSteps.read_back}
    real |= {"evaluate": train.evaluate, "log_step": train.log_step, "save": Saver.save}

    def read_back(self, recent):
        seen["sync"].append(self.steps[-1][0])
        return real["read_back"](self, recent)

    def log_step(cfg, tracker, state, *args, **kwargs):
        seen["log"].append(state.step)
        return real["log_step"](cfg, tracker, state, *args, **kwargs)

    def save(saver, state, final=False):
        seen["checkpoint"].append(state.step)
        return real["save"](saver, state, final)

    ov = overrides(tiny_data, tmp_path_factory.mktemp("watched"), "train.train_tokens=7168", "train.log_every=2")
    cfg = config.load(PRESET, [*ov, "train.val_every=3", "checkpoint.every_steps=4"])
    with pytest.MonkeyPatch.context() as m:
        m.setattr(data, "sha256_file", lambda path: seen["hashed"].append(path) or real["hash"](path))
        m.setattr(train.UnreadSteps, "read_back", read_back)
        m.setattr(train, "evaluate", lambda *a: seen["validate"].append(seen["sync"][-1]) or real["evaluate"](*a))
        m.setattr(train, "log_step", log_step)
        m.setattr(Saver, "save", save)
        summary = train.train(cfg)
    assert summary["exit_code"] == 0 and summary["steps"] == 7
    return cfg, seen


@pytest.mark.megatron_compat
def test_a_start_checks_the_dataset_once(watched_run):
    """One compatibility check per start (it hashes the tokenizer), not one per reader of the dataset."""
    cfg, seen = watched_run
    assert seen["hashed"] == [Path(cfg.data.tokenizer)]


@pytest.mark.megatron_compat
def test_the_loop_does_what_step_actions_says(watched_run):
    from pipeline.cadence import step_actions

    cfg, seen = watched_run
    actions = {step: step_actions(cfg, step, 7) for step in range(1, 8)}
    for action in ("sync", "log", "checkpoint"):
        assert seen[action] == [s for s, a in actions.items() if getattr(a, action)], action
    sets = len(cfg.validation_sets())  # a validation step scores every set: the run's val split and heldout
    assert sets == 2 and seen["validate"] == [s for s, a in actions.items() if a.validate for _ in range(sets)]
    assert seen["sync"] == [1, 2, 3, 4, 6, 7]  # step 5 is none of them: its loss is read back at step 6


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
    # every validation set at every train.val_every-th step and the last, once each across the stop
    assert validation_steps(tmp_path) == {"val/loss": [3, 6], "val/heldout/loss": [3, 6]}, stopped
    assert [got[s]["train/loss"] for s in range(stopped + 1, STEPS + 1)] == [
        ref[s]["train/loss"] for s in range(stopped + 1, STEPS + 1)
    ]


@pytest.mark.megatron_compat
def test_tp2_zero2_matches_tp1_and_resumes_exactly(reference, tiny_data, tmp_path):
    _, ref, _ = reference
    tp2 = ["parallel.tp=2", "parallel.zero_stage=2"]
    full = tmp_path / "full"
    run(overrides(tiny_data, full, *tp2), nproc=2)
    m = metrics(full)
    # Same data and math as TP=1: step 1 (same weights) agrees to fp32 reduction order; a missing mpu shows
    # up there as a ~40 % different grad norm. Later steps drift by summation order only.
    assert (m[1]["train/loss"], m[1]["train/grad_norm"]) == pytest.approx(
        (ref[1]["train/loss"], ref[1]["train/grad_norm"]), rel=1e-5
    )
    assert losses(m) == pytest.approx(losses(ref), rel=2e-3)
    assert losses(m, "train/grad_norm") == pytest.approx(losses(ref, "train/grad_norm"), rel=2e-3)
    killed = tmp_path / "killed"
    ov = overrides(tiny_data, killed, *tp2)
    kill_after_checkpoint(ov, 2, killed)
    run(ov, nproc=2)
    got = metrics(killed)
    for step in range(CKPT_EVERY + 1, STEPS + 1):
        assert (got[step]["train/loss"], got[step]["train/grad_norm"]) == (
            m[step]["train/loss"],
            m[step]["train/grad_norm"],
        )


def reference_loop(cfg: config.Config, dp_size: int, steps: int) -> tuple[list[float], list[float]]:
    """Plain PyTorch on one process over the same global batch a DP run sees: the batches of every DP rank's
    loader, summed gradients, torch's clip_grad_norm_ and the same AdamW groups and LR schedule."""
    import torch

    from pipeline import data, distributed
    from pipeline.lr_schedule import lr_at
    from pipeline.model import build_model, lm_loss
    from pipeline.train.engine import make_optimizer

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
    """Also the checkpoint clock over two ranks: checkpoint.every_minutes so small that every sync step is due
    (rank 0's clock, agreed by both), and step 4's background write slowed so that step 5's save waits for it;
    with the clock a milestone every 4 steps (not a multiple of every_steps=3, which the clock leaves unused)
    is kept while keep_last=1 prunes the rest. And the slowest rank named: rank 1 sleeps 0.5 s in each data
    fetch (the numbers do not change): rank 0 also runs the background writes, whose thread takes the GIL from
    its forward, so a smaller margin named rank 0 on a loaded machine."""
    clock = ("checkpoint.every_minutes=1e-6", "checkpoint.keep_every_steps=4", "checkpoint.keep_last=1")
    ov = overrides(tiny_data, tmp_path, "parallel.zero_stage=2", *clock)
    slow = {"PRISM_FAULT_CHECKPOINT_WRITE": "slow:4", "PRISM_FAULT_SLOW_RANK": "1:0.5"}
    log = run(ov, nproc=2, faults=slow).stdout
    staged = [
        int(line.split("step-")[1][:7]) for line in log.splitlines() if line.endswith("writing in the background")
    ]
    assert staged == list(range(1, STEPS + 1)), log  # log_every=1: every step is a sync step
    assert "checkpoint of step 5 waited" in log and "for step-0000004's background write" in log, log
    ckpt = checkpoint_dir(tmp_path)
    assert (ckpt / "latest").read_text() == "step-0000006" and checkpoint.verify(ckpt / "step-0000006") is None
    assert checkpoint.tag_names(ckpt) == ["step-0000004", "step-0000006"]  # the milestone and the newest
    assert checkpoint.milestone_tags(ckpt) == ["step-0000004", "step-0000006"]  # the last step is one too
    m = metrics(tmp_path)
    want_loss, want_norm = reference_loop(config.load(PRESET, ov), dp_size=2, steps=3)
    # step 1: same weights, same global batch; only the reduction order differs (a wrong DP averaging or
    # an unsplit batch would be off by far more)
    assert (m[1]["train/loss"], m[1]["train/grad_norm"]) == pytest.approx((want_loss[0], want_norm[0]), rel=2e-4)
    assert losses(m)[:3] == pytest.approx(want_loss, rel=2e-3)
    assert losses(m, "train/grad_norm")[:3] == pytest.approx(want_norm, rel=2e-3)
    assert all(m[s]["perf/slowest_rank"] == 1 and m[s]["perf/rank_time_max"] >= 1.0 for s in m)  # 2 fetches
    assert "| slowest rank 1 +" in log


def test_nan_steps_are_skipped_counted_and_stop_the_run_after_m_in_a_row(tiny_data, tmp_path):
    # NaN losses at steps 2, 4 and 5 (PRISM_FAULT_LOSS): step 2 is skipped and training goes on; 4 and 5 are
    # train.max_skips_in_a_row=2 skips in a row: exit 4 at step 5, before its checkpoint
    extra = ("train.max_skips_in_a_row=2", "checkpoint.every_steps=1", "checkpoint.keep_last=10")
    ov = overrides(tiny_data, tmp_path, *extra)
    faulty = {**env(), "PRISM_FAULT_LOSS": "2:nan,4:nan,5:nan"}
    out = subprocess.run(command(ov, 1), cwd=ROOT, env=faulty, capture_output=True, text=True, timeout=300)
    assert out.returncode == 4, out.stderr[-3000:]
    assert "prism train: step 2 skipped (loss nan" in out.stdout and "| skipped 1" in out.stdout
    m = metrics(tmp_path)
    assert [m[s]["train/skipped_steps"] for s in range(1, 5)] == [0, 1, 1, 2]
    assert m[1]["perf/slowest_rank"] == 0 and m[1]["perf/rank_time_max"] > 0  # one rank: itself
    ckpt = checkpoint_dir(tmp_path)
    assert (ckpt / "latest").read_text() == "step-0000004"  # nothing written at the step that stopped the run
    weights = {s: checkpoint.read_weights(ckpt / f"step-{s:07d}")[0] for s in (1, 2, 3)}
    assert all(torch_equal(weights[1][k], weights[2][k]) for k in weights[1])  # the skipped step changed nothing
    assert not all(torch_equal(weights[2][k], weights[3][k]) for k in weights[2])  # step 3 trained
    dump = json.loads((ckpt / "nonfinite-step-0000005-rank0.json").read_text())
    assert dump["step"] == 5 and dump["skips_in_a_row"] == 2 and dump["last_good_checkpoint"] == "step-0000004"
    assert not math.isfinite(dump["train_loss"])
    assert "prism train: error: 2 steps in a row skipped (train.max_skips_in_a_row)" in out.stderr
    assert (ckpt / "nonfinite-step-0000005-rank0.npz").exists()


def torch_equal(a, b) -> bool:
    import torch

    return not torch.is_tensor(a) or torch.equal(a, b)

"""Elastic resume: a checkpoint written by a DP=2 run (torchrun, gloo, ZeRO-1) resumes at DP=1 and at DP=4,
and one written at TP=2 resumes at TP=1 and one at TP=1 at TP=2 (both through DeepSpeed's universal
checkpoint, pipeline.checkpoint.reshard; see the tensor-parallel section).

The reference is the uninterrupted DP=2 run. Its step-3 checkpoint is copied (a rollback: `latest` points
at it) and resumed with another number of processes; the global batch stays 1024 tokens (grad accumulation
2 at DP=2, 4 at DP=1, 1 at DP=4). Checked after the change:
- step, token and LR counters continue exactly (same schedule);
- the data order: the loader positions saved at step 6 equal what pipeline.data.ShardLoader's mapping gives
  (tests/unit/test_loader_elastic.py shows that mapping reads every row once, in the old run's global
  batches); so each step after the change sees the same rows as the uninterrupted DP=2 run, and its loss
  equals that run's to fp32 reduction order (rel 1e-4);
- against an uninterrupted run at the new size, which reads the data in another order from step 1, the
  loss after the change agrees within 2 % (measured: see the part note).
A tensor-parallel change at ZeRO-0 (no optimizer partitions to re-split) is refused in one line before any
weights load.

The same in bf16 (the study's presets), where DeepSpeed runs its BF16_Optimizer: see the bf16 section.
"""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from pipeline import checkpoint, config, data
from pipeline.checkpoint import restore
from tests.integration.test_train import (
    PRESET,
    ROOT,
    checkpoint_dir,
    command,
    env,
    metrics,
    overrides,
    run,
    validation_steps,
)

STEP3, STEP6 = "step-0000003", "step-0000006"
# a downstream eval at every checkpoint of the DP=2 run and of its resumes, the cheapest that lm-eval scores
EVALS = ("train.eval_every=3", "train.eval_tasks=[arc_easy]", "train.eval_limit=4")
MICRO, ROWS_PER_STEP = 2, 8  # SMALL: micro_batch_size 2, 1024 tokens per step at seq_len 128


@pytest.fixture(scope="module")
def dp2(tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("dp2")
    run(overrides(tiny_data, out, *EVALS), nproc=2)
    return out, metrics(out)


def rolled_back_copy(dp2, tiny_data, tmp_path, *extra: str) -> tuple[list[str], object]:
    """A copy of the DP=2 run rolled back to its step-3 checkpoint: (its overrides, its checkpoint folder)."""
    src, _ = dp2
    shutil.copytree(src, tmp_path / "run")
    ckpt = checkpoint_dir(tmp_path / "run")
    shutil.rmtree(ckpt / STEP6)
    (ckpt / "latest").write_text(STEP3)
    lines = (ckpt / "metrics.jsonl").read_text().splitlines()
    (ckpt / "metrics.jsonl").write_text("".join(f"{x}\n" for x in lines if json.loads(x)["step"] <= 3))
    return overrides(tiny_data, tmp_path / "run", *extra), ckpt


def resumed_copy(dp2, tiny_data, tmp_path, nproc: int, *extra: str):
    """The DP=2 run rolled back to its step-3 checkpoint, resumed with ``nproc`` processes."""
    ov, ckpt = rolled_back_copy(dp2, tiny_data, tmp_path, *extra)
    return ov, run(ov, nproc=nproc), ckpt


def simulated_positions(cfg: config.Config, new_dp: int) -> list[dict]:
    """Loader states after 3 steps at DP=2 and 3 more at ``new_dp``, from ShardLoader alone."""

    def steps(group, n):
        for _ in range(n * ROWS_PER_STEP // (MICRO * len(group))):
            for loader in group:
                loader.next_batch()

    old = [data.ShardLoader(cfg, dp_rank=r, dp_size=2, batch_size=MICRO) for r in range(2)]
    steps(old, 3)
    saved = json.loads(json.dumps(old[0].state_dict()))
    new = [data.ShardLoader(cfg, dp_rank=r, dp_size=new_dp, batch_size=MICRO) for r in range(new_dp)]
    for loader in new:
        loader.load_state_dict(saved)
    steps(new, 3)
    for loader in old + new:
        loader.close()
    return [json.loads(json.dumps(loader.state_dict())) for loader in new]


@pytest.mark.parametrize("new_dp", [1, 4])
def test_dp2_checkpoint_resumes_at_another_dp_size(dp2, tiny_data, tmp_path, new_dp):
    _, ref = dp2
    ov, log, ckpt = resumed_copy(dp2, tiny_data, tmp_path, new_dp, *EVALS)
    assert f"resumed from {STEP3}" in log.stdout and "saved at data-parallel size 2, continuing at" in log.stdout
    assert f"world {new_dp} = TP 1 x DP {new_dp}" in log.stdout
    got = metrics(tmp_path / "run")
    assert_continues(got, ref, loss=1e-4, grad_norm=1e-3, val=1e-4)
    # both validation sets: step 3 before the change, step 6 after it, none repeated or skipped
    assert validation_steps(tmp_path / "run") == {"val/loss": [3, 6], "val/heldout/loss": [3, 6]}
    # and the downstream eval: step 3 in the DP=2 run, step 6 after the change, once each
    rows = [json.loads(x) for x in (ckpt / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval/arc_easy/acc" in r] == [3, 6]
    assert got[6]["val/heldout/loss"] == pytest.approx(ref[6]["val/heldout/loss"], rel=1e-4)
    # the data order the trainer followed is the loader's mapping, rank by rank
    _, info = checkpoint.read_weights(ckpt / STEP6)
    saved = [r["loader"] for r in info.client_state["prism"]["ranks"]]
    assert saved == simulated_positions(config.load(PRESET, ov), new_dp)
    assert json.loads((ckpt / STEP6 / "integrity.json").read_text())["dp_size"] == new_dp
    # an uninterrupted run at the new size reads other rows from step 1: close, not equal
    fresh = tmp_path / "fresh"
    run(overrides(tiny_data, fresh), nproc=new_dp)
    other = metrics(fresh)
    for s in (4, 5, 6):
        assert got[s]["train/loss"] == pytest.approx(other[s]["train/loss"], rel=0.02), s
    print(
        f"DP 2->{new_dp}: loss after the change vs uninterrupted DP=2 "
        + " ".join(f"{got[s]['train/loss'] / ref[s]['train/loss'] - 1:+.2e}" for s in (4, 5, 6))
        + f" val {got[6]['val/loss'] / ref[6]['val/loss'] - 1:+.2e}"
        + f" | vs uninterrupted DP={new_dp} "
        + " ".join(f"{got[s]['train/loss'] / other[s]['train/loss'] - 1:+.2e}" for s in (4, 5, 6))
    )


# --- bf16: DeepSpeed's BF16_Optimizer (bf16 weights, fp32 masters and gradient sums, ZeRO-1) ---------------
# The study's presets train in bf16 at ZeRO-1, where DeepSpeed runs BF16_Optimizer, not its ZeRO-1/2 optimizer.
BF16 = "train.precision=bf16"
# How close the bf16 run after the change comes to the uninterrupted DP=2 run's: to fp32 reduction order,
# because gradients are summed and all-reduced in fp32 (train.engine.deepspeed_config). Measured (steps 4-6 loss and
# grad norm, val), through DeepSpeed's universal checkpoint: DP=1 and DP=4 grad norms equal, loss within
# 6.0e-08 (step 6), val 4.5e-08; the hand-written partition merge this replaced gave the same numbers on the
# same code. With DeepSpeed's default bf16 all-reduce they drifted by up to 4.4e-04 (val), and a resume that loses the AdamW moments misses by 1.9e-02 at step 5.
# One that keeps bf16-rounded fp32 masters misses by 1.0e-04; test_bf16_elastic_load_joins_the_saved_partitions
# also checks the masters directly.
BF16_REL = 1e-6


@pytest.fixture(scope="module")
def dp2_bf16(tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("dp2_bf16")
    run(overrides(tiny_data, out, BF16), nproc=2)
    return out, metrics(out)


@pytest.mark.parametrize("new_dp", [1, 4])
def test_bf16_dp2_checkpoint_resumes_at_another_dp_size(dp2_bf16, tiny_data, tmp_path, new_dp):
    _, ref = dp2_bf16
    _, log, ckpt = resumed_copy(dp2_bf16, tiny_data, tmp_path, new_dp, BF16)
    assert f"resumed from {STEP3}" in log.stdout and "saved at data-parallel size 2, continuing at" in log.stdout
    assert f"world {new_dp} = TP 1 x DP {new_dp} | ZeRO-1 bf16" in log.stdout
    # BF16_Optimizer's files, one per DP rank: the bf16 path really ran
    assert len(list((ckpt / STEP6).glob("bf16_zero_pp_rank_*_optim_states.pt"))) == new_dp
    got = metrics(tmp_path / "run")
    assert sorted(got) == list(range(1, 7))
    print(
        f"bf16 DP 2->{new_dp} vs uninterrupted bf16 DP=2: loss "
        + " ".join(f"{got[s]['train/loss'] / ref[s]['train/loss'] - 1:+.2e}" for s in (4, 5, 6))
        + f" val {got[6]['val/loss'] / ref[6]['val/loss'] - 1:+.2e}"
        + " | grad_norm "
        + " ".join(f"{got[s]['train/grad_norm'] / ref[s]['train/grad_norm'] - 1:+.2e}" for s in (4, 5, 6))
    )
    assert_continues(got, ref, loss=BF16_REL, grad_norm=BF16_REL, val=BF16_REL)


def test_bf16_elastic_load_joins_the_saved_partitions(dp2_bf16, tiny_data, tmp_path):
    """In this process, at DP=1: after the elastic load of the DP=2 step-3 checkpoint, every param's fp32
    master and AdamW moments (read through DeepSpeed's per-param links) are its slice of the two saved
    partitions joined, and its bf16 weight is that master rounded."""
    import torch
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    from pipeline import distributed
    from pipeline.model import build_model
    from pipeline.train.engine import build_engine

    ov, ckpt = rolled_back_copy(dp2_bf16, tiny_data, tmp_path, BF16)
    cfg = config.load(PRESET, ov)
    distributed.init_model_parallel(1, cfg.run.seed)
    grad_accum = cfg.steps(1)["grad_accum"]
    engine, _ = build_engine(cfg, build_model(cfg), grad_accum=grad_accum, dp_size=1, load_universal=True)
    restore.load(engine, cfg, STEP3, restore.TrainState())
    files = [ckpt / STEP3 / f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)]
    saved = [torch.load(f, weights_only=False)["optimizer_state_dict"] for f in files]
    optimizer = engine.optimizer
    assert type(optimizer).__name__ == "BF16_Optimizer"
    for i, params in enumerate(optimizer.bf16_groups):
        master = torch.cat([s["single_partition_of_fp32_groups"][i] for s in saved])
        moments = {
            k: torch.cat([s["base_optimizer_state"]["state"][i][k] for s in saved]) for k in ("exp_avg", "exp_avg_sq")
        }
        offset = 0
        for p in params:
            part = slice(offset, offset + p.numel())
            assert torch.equal(safe_get_full_fp32_param(p), master[part].view_as(p))
            assert torch.equal(p.detach(), master[part].view_as(p).bfloat16())
            for key, saved_moment in moments.items():
                assert torch.equal(safe_get_full_optimizer_state(p, key), saved_moment[part].view_as(p)), key
            offset += p.numel()
        assert torch.equal(optimizer.fp32_groups_flat_partition[i][:offset], master[:offset])
        assert not optimizer.fp32_groups_flat_partition[i][offset:].any()  # this DP size's padding: zeros
    assert [float(state["step"]) for state in optimizer.optimizer.state.values()] == [3.0, 3.0]


# --- tensor-parallel changes: TP=2 -> 1 and TP=1 -> 2, through DeepSpeed's universal checkpoint --------------
# A Prism schedule with replicated attention at TP=2: the 3-head layers 1-2 run whole on every TP rank, the
# 12-head layers 3-4 are split; at TP=1 the flag changes nothing. One process per TP rank, DP 1 throughout.
REPLICATED = ["schedule.heads=3x2,12x2", "parallel.replicate_indivisible_layers=true"]


@pytest.fixture(scope="module")
def tp_runs(tiny_data, tmp_path_factory):
    """The uninterrupted fp32 runs at TP=1 and TP=2: {tp: (folder, metrics)}."""
    runs = {}
    for tp in (1, 2):
        out = tmp_path_factory.mktemp(f"tp{tp}")
        run(overrides(tiny_data, out, *REPLICATED, f"parallel.tp={tp}"), nproc=tp)
        runs[tp] = out, metrics(out)
    return runs


def resumed_at_tp(source, tiny_data, tmp_path, old_tp: int, new_tp: int, *extra: str):
    """The TP=old_tp run rolled back to its step-3 checkpoint, resumed at TP=new_tp: (log, metrics, ckpt)."""
    ov, ckpt = rolled_back_copy(source, tiny_data, tmp_path, *REPLICATED, f"parallel.tp={new_tp}", *extra)
    log = run(ov, nproc=new_tp)
    assert f"resumed from {STEP3}" in log.stdout, log.stdout[-3000:]
    assert f"saved at parallel.tp={old_tp}, continuing at {new_tp}" in log.stdout
    assert f"world {new_tp} = TP {new_tp} x DP 1" in log.stdout
    assert sorted(p.name for p in (ckpt / STEP6).glob("mp_rank_*_model_states.pt")) == [
        f"mp_rank_{r:02d}_model_states.pt" for r in range(new_tp)
    ]
    assert json.loads((ckpt / STEP6 / "integrity.json").read_text())["tp"] == new_tp
    assert not (ckpt / restore.UNIVERSAL).exists()  # the converted copy is gone once loaded
    return log, metrics(tmp_path / "run"), ckpt


def rel(got: dict, ref: dict, key: str, steps=(4, 5, 6)) -> list[float]:
    return [got[s][key] / ref[s][key] - 1 for s in steps]


def assert_continues(got: dict, ref: dict, loss: float, grad_norm: float, val: float) -> None:
    """Steps 4-6 after the resume against the uninterrupted run: lr and tokens exactly, loss, grad norm and
    the final val loss within the given relative tolerances."""
    assert sorted(got) == list(range(1, 7))
    for s in (4, 5, 6):
        assert got[s]["train/lr"] == ref[s]["train/lr"]
        assert got[s]["train/tokens_seen"] == ref[s]["train/tokens_seen"] == s * 1024
        assert got[s]["train/loss"] == pytest.approx(ref[s]["train/loss"], rel=loss), s
        assert got[s]["train/grad_norm"] == pytest.approx(ref[s]["train/grad_norm"], rel=grad_norm), s
    assert got[6]["val/loss"] == pytest.approx(ref[6]["val/loss"], rel=val)


@pytest.mark.parametrize("old_tp,new_tp", [(2, 1), (1, 2)])
def test_a_checkpoint_resumes_at_another_tp_size(tp_runs, tiny_data, tmp_path, old_tp, new_tp):
    ref = tp_runs[old_tp][1]
    _, got, _ = resumed_at_tp(tp_runs[old_tp], tiny_data, tmp_path, old_tp, new_tp)
    other = tp_runs[new_tp][1]  # uninterrupted at the new size: same data order, other reduction order
    print(
        f"fp32 TP {old_tp}->{new_tp} vs uninterrupted TP={old_tp}: loss "
        + " ".join(f"{x:+.2e}" for x in rel(got, ref, "train/loss"))
        + " grad_norm "
        + " ".join(f"{x:+.2e}" for x in rel(got, ref, "train/grad_norm"))
        + f" val {rel(got, ref, 'val/loss', (6,))[0]:+.2e} | vs uninterrupted TP={new_tp}: loss "
        + " ".join(f"{x:+.2e}" for x in rel(got, other, "train/loss"))
    )
    # the DP cases' tolerances: fp32 at TP=1 and TP=2 compute the same sums (dropout 0)
    assert_continues(got, ref, loss=1e-4, grad_norm=1e-3, val=1e-4)
    for s in (4, 5, 6):
        assert got[s]["train/loss"] == pytest.approx(other[s]["train/loss"], rel=1e-4), s


def test_a_tensor_parallel_change_at_zero_0_is_refused_before_any_weights_load(tp_runs, tiny_data, tmp_path):
    src, _ = tp_runs[2]
    shutil.copytree(src, tmp_path / "run")
    zero0 = ["parallel.tp=1", "parallel.zero_stage=0", "checkpoint.allow_changes=[parallel.zero_stage]"]
    ov = overrides(tiny_data, tmp_path / "run", *REPLICATED, *zero0)
    out = subprocess.run(command(ov, 1), cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if line.startswith("prism train: error:")]
    assert len(lines) == 1, out.stderr[-3000:]
    assert "cannot resume at parallel.tp=1, the checkpoint was written at parallel.tp=2" in lines[0]
    assert "needs parallel.zero_stage 1 or 2 (saved at 1, this run 0)" in lines[0]
    assert "resume with parallel.tp=2" in lines[0]
    assert "| world 1 = TP" not in out.stdout  # refused before the engine (and its banner) exists


@pytest.fixture(scope="module")
def tp_runs_bf16(tiny_data, tmp_path_factory):
    runs = {}
    for tp in (1, 2):
        out = tmp_path_factory.mktemp(f"tp{tp}_bf16")
        run(overrides(tiny_data, out, *REPLICATED, f"parallel.tp={tp}", BF16), nproc=tp)
        runs[tp] = out, metrics(out)
    return runs


# In bf16 a TP change changes the arithmetic (each rank's matmul covers other columns, and the row-parallel
# partial sums are all-reduced in bf16), so after the change the run follows TP=1's rounding, not TP=2's.
# Measured (steps 4-6, vs the uninterrupted TP=2 run): loss <= 9.0e-06, grad norm <= 4.7e-03, val 6.3e-06;
# the uninterrupted TP=1 and TP=2 runs differ from each other by up to 1.2e-04 (loss), 2.6e-02 (grad norm) and
# 5.6e-05 (val) over their 6 steps. A resume that loses the AdamW moments misses the loss by ~2e-02 (see bf16
# above), which these bounds catch.
BF16_TP_REL, BF16_TP_GRAD_NORM_REL = 1e-4, 1e-2


def test_bf16_tp2_checkpoint_resumes_at_tp1(tp_runs_bf16, tiny_data, tmp_path):
    ref, other = tp_runs_bf16[2][1], tp_runs_bf16[1][1]
    _, got, ckpt = resumed_at_tp(tp_runs_bf16[2], tiny_data, tmp_path, 2, 1, BF16)
    assert len(list((ckpt / STEP6).glob("bf16_zero_pp_rank_*_optim_states.pt"))) == 1
    print(
        "bf16 TP 2->1 vs uninterrupted TP=2: loss "
        + " ".join(f"{x:+.2e}" for x in rel(got, ref, "train/loss"))
        + " grad_norm "
        + " ".join(f"{x:+.2e}" for x in rel(got, ref, "train/grad_norm"))
        + f" val {rel(got, ref, 'val/loss', (6,))[0]:+.2e} | uninterrupted TP=1 vs TP=2: loss "
        + " ".join(f"{x:+.2e}" for x in rel(other, ref, "train/loss"))
        + " grad_norm "
        + " ".join(f"{x:+.2e}" for x in rel(other, ref, "train/grad_norm"))
        + f" val {rel(other, ref, 'val/loss', (6,))[0]:+.2e}"
    )
    assert_continues(got, ref, loss=BF16_TP_REL, grad_norm=BF16_TP_GRAD_NORM_REL, val=BF16_TP_REL)

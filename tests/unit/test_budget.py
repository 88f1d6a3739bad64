"""`prism plan`: every figure against a hand computation, the trainer's layout rules, the epoch rule against
the real tiny dataset's manifest, the one-line refusals, and the verb's speed without torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import budget, config, model_size
from pipeline.config import ConfigError
from pipeline.dataset import DataError

ROOT = Path(__file__).resolve().parents[2]
P757 = ROOT / "configs" / "prism_757m.yaml"


def test_757m_on_one_node_of_eight_by_hand():
    cfg = config.load(P757)
    p = budget.make_budget(cfg, nodes=1, gpus_per_node=8, mfu=0.4, peak_flops=989e12)
    # layout: 524,288 tokens/step = micro 8 x seq 1024 x accum A x DP 8 -> A = 8
    assert (p.world, p.tp, p.dp, p.micro_batch, p.grad_accum) == (8, 1, 8, 8, 8)
    # steps: floor(20.97e9 / 524,288) = 39,997; warmup round(0.025 x 39,997) = round(999.925) = 1,000
    assert (p.steps, p.warmup, p.tokens) == (39_997, 1_000, 39_997 * 524_288)
    # parameters: per layer 4d^2 (attention) + 3 d f (SwiGLU) + 4d (two LayerNorms, weight + bias);
    # tied embedding 50,304 x d (50,257 padded to 128); final LayerNorm 2d
    d, f, layers = 1536, 4096, 24
    per_layer = 4 * d * d + 3 * d * f + 4 * d
    assert p.parameters == layers * per_layer + 50_304 * d + 2 * d == 756_894_720
    # FLOPs/token: 3 x (per layer 8d^2 + 4 d s + 6 d f, plus logits 2 d V)
    fwd = layers * (8 * d * d + 4 * d * 1024 + 6 * d * f) + 2 * d * 50_304
    assert p.flops_per_token == 3 * fwd
    # wall time: FLOPs / (MFU x peak x GPUs)
    assert p.wall_seconds == pytest.approx(3 * fwd * 39_997 * 524_288 / (0.4 * 989e12 * 8))
    # epochs: not prepared here, the preset names FineWeb sample/100BT (100B tokens)
    assert p.epochs == pytest.approx(39_997 * 524_288 / 100e9) and "100BT" in p.epochs_source


def test_validation_and_evals_of_the_757m_defaults_by_hand():
    """validation every 250 steps and at the last (160 of 39,997) over 5,242,880 tokens; evals every 2,000 and
    at the last (20) over the four whole offline sets; each a forward pass, a third of a training token's
    FLOPs: at most 2 % of the run's wall time."""
    from pipeline.eval.catalog import eval_tokens
    from pipeline.eval.plan import aside_cost, format_aside_cost

    cfg = config.load(P757)
    a = aside_cost(cfg, budget.make_budget(cfg, nodes=1, gpus_per_node=8, mfu=0.4, peak_flops=989e12).steps)
    assert (a["validations"], a["validation_tokens"], a["evals"]) == (160, 5_242_880, 20)
    assert a["eval_tokens"] == eval_tokens(("hellaswag", "piqa", "winogrande", "arc_easy"), None) > 3_000_000
    forward = (160 * 5_242_880 + 20 * a["eval_tokens"]) / 3
    assert a["share"] == pytest.approx(forward / (39_997 * 524_288 + forward))
    assert a["share"] == pytest.approx(a["validation_share"] + a["eval_share"]) and a["share"] <= 0.02
    text = "\n".join(format_aside_cost(cfg, a, budget.make_budget(cfg, gpus_per_node=8, peak_flops=989e12)))
    assert f"val + eval   {a['share']:.2%} of the run's wall time" in text and "share = (N_val x T_val" in text
    assert aside_cost(config.load(P757, ["train.eval_every=0"]), 39_997)["evals"] == 0


@pytest.mark.parametrize(
    ("stage", "precision", "expected"),
    [  # bytes per parameter: (weights, gradients, optimizer) and which are divided by DP = 8
        (0, "fp32", (4, 4, 8)),  # ZeRO-0 only in fp32 (bf16 would accumulate gradients in bf16)
        (1, "bf16", (2, 4, 12 / 8)),
        (2, "bf16", (2, 4 / 8, 12 / 8)),
        (3, "bf16", (2 / 8, 4 / 8, 12 / 8)),
        (1, "fp32", (4, 4, 8 / 8)),
    ],
)
def test_memory_per_gpu_by_zero_stage_by_hand(stage, precision, expected):
    cfg = config.load(P757, [f"parallel.zero_stage={stage}", f"train.precision={precision}"])
    mem = budget.memory_per_gpu(cfg, dp_size=8)
    n = 756_894_720
    assert mem["parameters"] == pytest.approx(n * expected[0])
    assert mem["gradients"] == pytest.approx(n * expected[1])
    assert mem["optimizer"] == pytest.approx(n * expected[2])
    # activations: 24 layers x s b d (10 + 24) + fp32 logits and their gradient 8 s b V (SDPA keeps no scores)
    s, b, d = 1024, 8, 1536
    assert mem["activations"] == pytest.approx(24 * s * b * d * 34 + 8 * s * b * 50_304)
    assert mem["total"] == pytest.approx(sum(v for k, v in mem.items() if k != "total"))


def test_tensor_parallel_divides_weights_and_megatron_attention_stores_scores():
    cfg = config.load(P757, ["parallel.tp=2", "model.attention_backend=megatron"])
    mem = budget.memory_per_gpu(cfg, dp_size=4)
    n_tp2 = model_size.parameter_count(cfg)  # vocab padded to 128 x 2 = 256: 50,432
    assert n_tp2 == 24 * (4 * 1536**2 + 3 * 1536 * 4096 + 4 * 1536) + 50_432 * 1536 + 2 * 1536
    assert mem["parameters"] == pytest.approx(n_tp2 / 2 * 2)
    heads = (6,) * 3 + (12,) * 3 + (16,) * 18
    s, b, d = 1024, 8, 1536
    want = sum(s * b * d * (10 + 24 / 2) + 5 * h * s * s * b / 2 for h in heads) + 8 * s * b * 50_432 / 2
    assert mem["activations"] == pytest.approx(want)


def test_layout_is_the_trainers_and_refusals_are_one_line():
    cfg = config.load(P757, ["parallel.tp=2"])
    assert budget.make_budget(cfg, 2, 8).dp == 8
    with pytest.raises(ConfigError, match=r"world size 3 is not divisible by parallel.tp=2"):
        budget.make_budget(cfg, 1, 3)
    # 6 GPUs: 524,288 is not a multiple of 1024 x 8 x 6 (the trainer's cfg.steps refuses the same way)
    with pytest.raises(ConfigError, match=r"train.batch_tokens=524288 is not divisible .* x 6 = 49152"):
        budget.make_budget(config.load(P757), 1, 6)
    with pytest.raises(ConfigError, match="--mfu"):
        budget.make_budget(config.load(P757), 1, 8, mfu=1.5)
    with pytest.raises(ConfigError, match="--nodes 0"):
        budget.make_budget(config.load(P757), 0, 8)


def test_unknown_input_and_no_peak_say_unknown():
    cfg = config.load(P757, ["data.input=/somewhere/else", "data.dataset_dir=/nonexistent"])
    p = budget.make_budget(cfg, 1, 8)
    assert p.epochs is None and p.wall_seconds is None
    text = budget.format_budget(cfg, p)
    assert "epochs       unknown" in text and "wall time    unknown" in text


def test_epochs_from_the_prepared_manifest_by_hand(tiny_data):
    cfg = config.load(ROOT / "configs" / "tiny_prism.yaml", [*tiny_data.overrides, "train.batch_tokens=1024"])
    m = tiny_data.manifest
    shards = len(m["splits"]["train"]["shards"])
    per_shard = m["splits"]["train"]["samples_per_shard"] * m["sequences_per_sample"] * 128
    for dp in (1, 4):  # DP=4 drops the shards beyond a multiple of 4, as the loader does
        assert budget.tokens_per_epoch(m, dp) == shards // dp * dp * per_shard
    p = budget.make_budget(cfg, 1, 1, manifest=m)
    assert p.epochs == pytest.approx(cfg.train.train_tokens / (shards * per_shard))
    assert "manifest" in p.epochs_source


def test_budget_beyond_one_epoch_is_refused_unless_allow_repeat(tiny_data):
    m = tiny_data.manifest
    one_epoch = budget.tokens_per_epoch(m, 1)
    over = (one_epoch // 1024 + 1) * 1024
    base = [*tiny_data.overrides, "train.batch_tokens=1024", "train.micro_batch_size=8"]
    cfg = config.load(ROOT / "configs" / "tiny_prism.yaml", [*base, f"train.train_tokens={over}"])
    with pytest.raises(DataError) as e:
        budget.check_epochs(cfg, m, 1)
    msg = str(e.value)
    assert f"train.train_tokens={over:,}" in msg and f"({one_epoch:,} tokens at DP=1)" in msg
    assert "data.allow_repeat=true" in msg and "\n" not in msg
    allowed = config.load(
        ROOT / "configs" / "tiny_prism.yaml", [*base, f"train.train_tokens={over}", "data.allow_repeat=true"]
    )
    assert budget.check_epochs(allowed, m, 1) == pytest.approx(over / one_epoch)
    exact = config.load(ROOT / "configs" / "tiny_prism.yaml", [*base, f"train.train_tokens={one_epoch}"])
    assert budget.check_epochs(exact, m, 1) == pytest.approx(1.0)


def test_paper_presets_hold_their_budget_in_one_epoch():
    for scale in ("124m", "354m", "757m"):
        for arm in ("prism", "uniform"):
            p = budget.make_budget(config.load(ROOT / "configs" / f"{arm}_{scale}.yaml"), 1, 8)
            assert p.epochs is not None and p.epochs <= 1, (arm, scale, p.epochs)


def test_verify_on_start_auto_rule(tiny_data, monkeypatch):
    cfg = config.load(ROOT / "configs" / "tiny_prism.yaml", tiny_data.overrides)
    assert cfg.data.verify_on_start == "auto"
    size = budget.dataset_bytes(cfg, tiny_data.manifest)
    assert 0 < size <= budget.VERIFY_AUTO_BYTES and budget.should_verify_on_start(cfg, tiny_data.manifest)
    monkeypatch.setattr(budget, "VERIFY_AUTO_BYTES", size - 1)  # one byte over the limit: not hashed up front
    assert not budget.should_verify_on_start(cfg, tiny_data.manifest)
    on = config.load(ROOT / "configs" / "tiny_prism.yaml", [*tiny_data.overrides, "data.verify_on_start=true"])
    assert budget.should_verify_on_start(on, tiny_data.manifest)


def test_prism_plan_cli_prints_the_plan_without_heavy_imports():
    code = (
        "import sys\n"
        "from pipeline.cli import main\n"
        f"rc = main(['plan', {str(P757)!r}, '--nodes', '1', '--gpus-per-node', '8', '--peak-tflops', '989'])\n"
        "print(sorted({'torch', 'megatron', 'deepspeed', 'datatrove', 'mlflow'} & set(sys.modules))); sys.exit(rc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "TP 1 x DP 8" in out.stdout and "grad_accum 8" in out.stdout and "39,997 optimizer steps" in out.stdout
    assert "memory/GPU" in out.stdout and "wall time    9 h" in out.stdout
    lines = out.stdout.strip().splitlines()
    assert lines[-1] == "[]"  # arithmetic only: no heavy import, so it answers in well under a second
    bad = plan_in_a_subprocess("--gpus-per-node", "6")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "49152" in bad.stderr


def plan_in_a_subprocess(*args: str) -> subprocess.CompletedProcess:
    """`prism plan` on the 757M preset as a user runs it (exit code and stderr)."""
    cmd = [sys.executable, "-m", "pipeline.cli", "plan", str(P757), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_allow_repeat_and_verify_on_start_may_change_on_resume():
    """Neither changes which tokens are read in which order, so resume must not refuse them."""
    old = config.load(ROOT / "configs" / "tiny_prism.yaml").to_dict()
    new = config.load(
        ROOT / "configs" / "tiny_prism.yaml", ["data.allow_repeat=true", "data.verify_on_start=false"]
    ).to_dict()
    assert config.changed_keys(old, new) == []
    assert config.changed_keys(old, config.load(ROOT / "configs" / "tiny_prism.yaml", ["data.limit=5"]).to_dict()) == [
        "data.limit"
    ]


def test_gpu_name_takes_its_peak_from_the_table(capsys):
    from pipeline.cli import main
    from pipeline.hardware import PEAK_BF16_FLOPS

    name, peak = next(iter(PEAK_BF16_FLOPS.items()))
    assert main(["plan", str(P757), "--gpus-per-node", "8", "--gpu", name]) == 0
    want = budget.make_budget(config.load(P757), 1, 8, peak_flops=peak)
    assert f"of {peak / 1e12:,.0f} TFLOP/s per GPU" in capsys.readouterr().out and want.wall_seconds


@pytest.mark.parametrize(
    "typed, name",
    [
        ("H200", "NVIDIA H200"),  # not H200 NVL (exact words win), not GH200 (words match from their start)
        ("h200 nvl", "NVIDIA H200 NVL"),
        ("h100 sxm", "NVIDIA H100 80GB HBM3"),  # the form factor torch's name leaves out, from the alias
        ("H100-PCIe", "NVIDIA H100 PCIe"),
        ("l40", "NVIDIA L40"),  # not L40S
        ("nvidia a100-sxm4-40gb", "NVIDIA A100-SXM4-40GB"),
    ],
)
def test_gpu_accepts_a_unique_part_of_a_table_name(typed, name, capsys):
    from pipeline.cli import main
    from pipeline.hardware import PEAK_BF16_FLOPS, find_gpu

    assert find_gpu(typed) == name
    assert main(["plan", str(P757), "--gpus-per-node", "8", "--gpu", typed]) == 0
    assert f"of {PEAK_BF16_FLOPS[name] / 1e12:,.0f} TFLOP/s per GPU" in capsys.readouterr().out


def test_gpu_names_that_share_one_peak_are_not_ambiguous():
    from pipeline.hardware import PEAK_BF16_FLOPS, find_gpu

    # A100-80GB is the SXM4 or the PCIe card: both 312 TFLOP/s, so either answers --gpu's question
    assert PEAK_BF16_FLOPS[find_gpu("A100-80GB")] == 312e12
    assert find_gpu("A100-80GB") in ("NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe")


@pytest.mark.parametrize(
    "typed, listed",
    [
        ("H100", ["NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H100 NVL"]),  # 989.5 / 756.5 / 835.5
        ("sxm", ["NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA A100-SXM4-40GB"]),  # aliases count too
    ],
)
def test_gpu_refuses_an_ambiguous_name_listing_the_matches(typed, listed):
    out = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "plan", str(P757), "--gpu", typed],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "ambiguous" in out.stderr and all(name in out.stderr for name in listed)
    assert "Traceback" not in out.stderr


def test_gpu_refuses_an_unknown_name_naming_the_way_out(capsys):
    from pipeline.cli import main

    assert main(["plan", str(P757), "--gpu", "B300"]) == 2
    err = capsys.readouterr().err
    assert "matches no GPU" in err and "--peak-tflops" in err and "NVIDIA B200" in err


def test_checkpoint_plan_757m_by_hand():
    """The issue's 757M figures: bf16 weights 1.5 GB + fp32 masters 3.0 + AdamW moments 6.1 = 10.6 GB; DP rank 0
    holds the weights and 1/8 of the rest; Young-Daly is sqrt(2 C M) with M the node MTBF over the nodes."""
    import math

    from pipeline.checkpoint.plan import HOST_COPY_GBPS, MTBF_NODE_HOURS, checkpoint_plan

    cfg = config.load(P757)
    n = model_size.parameter_count(cfg)
    one = checkpoint_plan(cfg, nodes=1, tp=1, dp=8, fs_gbps=2.0)
    assert (one.bytes_weights, one.bytes_optimizer) == (2 * n, 12 * n) == (
        budget.checkpoint_bytes(cfg)["weights"],
        12 * n,
    ) and round(one.bytes_total / 1e9, 1) == 10.6
    assert one.bytes_largest_rank == 2 * n + 12 * n / 8
    assert one.blocked_async_s == pytest.approx(one.bytes_largest_rank / (HOST_COPY_GBPS * 1e9))
    assert round(MTBF_NODE_HOURS) == 6335  # 2,048 nodes x 54 days x 24 h / 419 interruptions
    eight = checkpoint_plan(cfg, nodes=8, tp=1, dp=64, fs_gbps=2.0)
    assert eight.job_mtbf_hours == pytest.approx(MTBF_NODE_HOURS / 8)
    c, m = eight.blocked_async_s, MTBF_NODE_HOURS / 8 * 3600
    assert eight.young_daly_async_minutes == pytest.approx(math.sqrt(2 * c * m) / 60)
    assert eight.recommended_minutes >= eight.background_s / 60
    slow = checkpoint_plan(cfg, nodes=8, tp=1, dp=64, fs_gbps=0.001)  # the background write outlasts tau
    assert slow.recommended_minutes == pytest.approx(slow.background_s / 60)


def test_prism_plan_prints_the_checkpoint_lines_and_refuses_a_bad_bandwidth(capsys):
    from pipeline.cli import main

    assert main(["plan", str(P757), "--gpus-per-node", "8", "--gpu", "h100 sxm"]) == 0
    out = capsys.readouterr().out
    assert "10.6 GB per save" in out and "Young-Daly" in out and "--mtbf-node-hours 6,335 / 1 node(s)" in out
    assert "recommended checkpoint.every_minutes=41" in out and "this config: every 41 min" in out
    bad = plan_in_a_subprocess("--fs-gbps", "0")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "--fs-gbps" in bad.stderr


def test_a_cooldown_branch_plans_its_own_steps_and_names_the_shared_prefix():
    """A branch at step 9,900 of the 124M WSD-S main run trains its 1,100 decay steps: its steps, tokens and wall
    time are those, not the main run's 9,900 before it (a line of their own)."""
    wsd = ROOT / "configs" / "wsds" / "prism_124m.yaml"
    main = config.load(wsd)
    per_step = main.train.batch_tokens
    branch = config.load(wsd, ["cooldown.from_step=9900", f"cooldown.decay_tokens={1100 * per_step}"])
    m, b = (budget.make_budget(c, 1, 8, mfu=0.4, peak_flops=989e12) for c in (main, branch))
    assert (m.steps, m.shared_steps, m.tokens) == (44_000, 0, 44_000 * per_step)
    assert (b.steps, b.shared_steps, b.tokens, b.warmup) == (1_100, 9_900, 1_100 * per_step, 0)
    assert b.wall_seconds == pytest.approx(m.wall_seconds * 1_100 / 44_000)
    text = budget.format_budget(branch, b)
    assert "steps        1,100 optimizer steps, 0 warmup" in text and f"tokens       {1100 * per_step:,}\n" in text
    assert f"main run     steps 1-9,900 ({9900 * per_step:,} tokens) shared with runs/prism-124m-s" in text
    assert "this branch trains steps 9,901-11,000" in text
    assert "main run " not in budget.format_budget(main, m)

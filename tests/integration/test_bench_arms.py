"""benchmarks/bench_arms.py at tiny size on CPU: both arms run through `prism train` under torchrun and every
reported field is there and consistent with the trainer's own metrics. Never timings."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_arms_reports_both_arms_from_the_trainer(tmp_path):
    out = tmp_path / "result.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable,
        "benchmarks/bench_arms.py",
        "--steps",
        "5",
        "--warmup",
        "1",
        "--profile-steps",
        "1",
        "--device",
        "cpu",
        "--peak-flops",
        "1e12",
        "--workdir",
        str(tmp_path / "work"),
        "--json",
        str(out),
        "train.batch_tokens=1024",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert json.loads(proc.stdout.splitlines()[-1].removeprefix("BENCH_ARMS ")) == result
    assert (result["device"], result["precision"], result["steps"]) == ("cpu", "fp32", 5)
    prism, uniform = result["arms"]["prism"], result["arms"]["uniform"]
    assert prism["heads_per_layer"] != uniform["heads_per_layer"]  # really the two arms
    assert len(set(uniform["heads_per_layer"])) == 1
    for arm in (prism, uniform):
        assert arm["steps_logged"] == 5 and arm["steps_counted"] == 2  # warm-up and profiled steps left out
        assert arm["tokens_per_sec"] > 0 and arm["peak_memory_gb"] > 0
        # MFU is the trainer's: tokens/s x FLOPs per token / peak, so it scales with tokens/s
        assert 0 < arm["mfu_causal"] < arm["mfu"]
        assert arm["sdpa"].startswith("d_h ")
        assert set(arm["profile_ms"]) == {"matmul", "attention", "other"}
        assert arm["profile_ms"]["matmul"] > 0 and arm["profile_ms"]["attention"] > 0
        assert abs(sum(arm["profile_share"].values()) - 1) < 1e-3
        # each layer's forward and backward, from the named ranges of the profiled step (#42)
        layers = arm["layer_ms_per_step"]
        assert sorted(layers, key=int) == [str(i) for i in range(1, len(arm["heads_per_layer"]) + 1)]
        assert all(t["forward"] > 0 and t["backward"] > 0 for t in layers.values())
    # prism's plan has more distinct head dims than uniform's, and the log names each one
    assert prism["sdpa"].count("d_h ") == len({192 // h for h in prism["heads_per_layer"]})
    assert uniform["sdpa"].count("d_h ") == 1
    ratio = result["ratio_prism_over_uniform_tokens_per_sec"]
    assert abs(ratio - prism["tokens_per_sec"] / uniform["tokens_per_sec"]) < 1e-9
    assert "ratio prism/uniform tokens_per_sec" in proc.stdout
    table = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "layer" not in line]
    assert len(table) == len(prism["heads_per_layer"])  # one row per layer, both arms side by side
    assert not (tmp_path / "work" / "data").exists()  # the synthetic tokens are removed afterwards

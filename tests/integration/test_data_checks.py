"""The data checks at `prism train` start, through the real CLI: a budget beyond one epoch is refused (and
really repeats when allowed), a manifest missing a key is named in `train` and `prepare --verify`, and
data.verify_on_start finds a damaged shard before step 1."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from pipeline import budget, config, data

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ["train.batch_tokens=1024", "train.micro_batch_size=8", "train.val_tokens=1024", "tracking.enabled=false"]


def prism(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli", *args], capture_output=True, text=True, timeout=600, cwd=ROOT, env=env
    )


def train_tiny(tiny_data, *overrides: str) -> subprocess.CompletedProcess:
    """`prism train` of the tiny preset on the session's dataset, with these overrides last."""
    return prism("train", "configs/tiny_prism.yaml", *tiny_data.overrides, *TRAIN, *overrides)


def copy_dataset(tiny_data, tmp_path) -> Path:
    dst = tmp_path / "dataset"
    shutil.copytree(tiny_data.dataset_dir, dst, ignore=shutil.ignore_patterns(".prep"))
    return dst


def one_line_error(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    # Megatron's import warnings (no TE/apex) may precede it; the error itself is one line
    lines = [line for line in out.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and lines[0] == out.stderr.strip().splitlines()[-1], out.stderr
    return lines[0]


def test_train_refuses_a_budget_beyond_one_epoch_before_building_the_model(tiny_data, tmp_path):
    one_epoch = budget.tokens_per_epoch(tiny_data.manifest, 1)
    over = (one_epoch // 1024 + 1) * 1024
    out = train_tiny(tiny_data, f"train.train_tokens={over}", f"run.output_dir={tmp_path}")
    line = one_line_error(out)
    assert f"train.train_tokens={over:,}" in line and f"{one_epoch:,} tokens at DP=1" in line
    assert "data.allow_repeat=true" in line
    assert not [ln for ln in out.stdout.splitlines() if ln.startswith("step ")]  # no step ran
    ckpt = tmp_path / "prism-tiny-s1234" / "checkpoints"  # resume_point may create it, empty, to probe writing
    assert not ckpt.exists() or not any(ckpt.iterdir())


def test_loader_really_repeats_the_data_in_a_new_order(tiny_data):
    cfg = config.load(ROOT / "configs" / "tiny_prism.yaml", [*tiny_data.overrides, *TRAIN, "data.allow_repeat=true"])
    loader = data.ShardLoader(cfg, dp_rank=0, dp_size=1, batch_size=8)
    rows_per_epoch = budget.tokens_per_epoch(tiny_data.manifest, 1) // 128
    epochs = [np.concatenate([loader.next_batch() for _ in range(rows_per_epoch // 8)]) for _ in range(2)]
    loader.close()
    assert loader.position.epoch == 2
    first, second = ({r.tobytes() for r in e} for e in epochs)
    assert first == second and len(first) == rows_per_epoch  # every row again, once
    assert not np.array_equal(epochs[0], epochs[1])  # reshuffled


def test_manifest_missing_a_key_is_named_in_train_and_prepare_verify(tiny_data, tmp_path):
    ds = copy_dataset(tiny_data, tmp_path)
    manifest = json.loads((ds / "manifest.json").read_text())
    del manifest["tokenizer"]["vocab_size"]
    (ds / "manifest.json").write_text(json.dumps(manifest))
    line = one_line_error(prism("prepare", "--verify", str(ds)))
    assert "tokenizer.vocab_size is missing" in line
    out = train_tiny(
        tiny_data, "train.train_tokens=2048", f"data.dataset_dir={ds}", f"run.output_dir={tmp_path / 'runs'}"
    )
    assert "tokenizer.vocab_size is missing" in one_line_error(out)


def test_verify_on_start_finds_a_damaged_shard_before_step_1(tiny_data, tmp_path):
    ds = copy_dataset(tiny_data, tmp_path)
    # Damage the last train shard in place (same size): a 2-step run would never read it.
    victim = ds / tiny_data.manifest["splits"]["train"]["shards"][-1]["path"]
    raw = bytearray(victim.read_bytes())
    raw[2000] ^= 0xFF
    victim.write_bytes(bytes(raw))
    out = train_tiny(
        tiny_data,
        "train.train_tokens=2048",
        f"data.dataset_dir={ds}",
        f"run.output_dir={tmp_path / 'runs'}",
        "data.verify_on_start=true",
    )
    line = one_line_error(out)
    assert line.startswith("prism train: error: data.verify_on_start:") and str(victim) in line
    assert "sha256 differs" in line and "step" not in out.stdout

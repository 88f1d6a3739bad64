"""The DP-aware shard loader on the real prepared tiny dataset: assignment, determinism, exact position
restore, the fixed val set, and the refusals (corrupt shard, tokenizer / vocab / seq_len mismatch)."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pipeline import config, data

ROOT = Path(__file__).resolve().parent.parent


def load_cfg(tiny_data, *extra: str, preset: str = "tiny_prism.yaml") -> config.Config:
    return config.load(ROOT / "configs" / preset, [*tiny_data.overrides, *extra])


def train_rows(cfg: config.Config) -> list[bytes]:
    """Every row of the train split, as bytes (for multiset comparisons)."""
    manifest = data.read_manifest(cfg.data.dataset_dir)
    info = manifest["splits"]["train"]
    rows = []
    for entry in info["shards"]:
        shard = data.Shard(Path(cfg.data.dataset_dir), entry, manifest, info["samples_per_shard"])
        rows += [r.astype(np.int64).tobytes() for s in shard.samples for r in s]
    return rows


def test_dp_ranks_get_disjoint_equal_shards_every_epoch(tiny_data):
    cfg = load_cfg(tiny_data)
    n = len(data.read_manifest(cfg.data.dataset_dir)["splits"]["train"]["shards"])
    assert n >= 2, "the tiny dataset needs >= 2 train shards for DP tests"
    for epoch in range(3):
        per_rank = [data.ShardLoader(cfg, dp_rank=r, dp_size=2, batch_size=4).epoch_shards(epoch) for r in range(2)]
        assert len(per_rank[0]) == len(per_rank[1]) == n // 2  # remainder dropped: equal counts
        assert not set(per_rank[0]) & set(per_rank[1])
    loader = data.ShardLoader(cfg, dp_rank=0, dp_size=1, batch_size=4)
    assert sorted(loader.epoch_shards(0)) == list(range(n))
    # the per-epoch shuffle changes the sample order, and the seed changes it too
    assert not np.array_equal(loader.row_order(0, 0), loader.row_order(1, 0))
    other_seed = data.ShardLoader(load_cfg(tiny_data, "run.seed=7"), dp_rank=0, dp_size=1, batch_size=4)
    assert not np.array_equal(loader.row_order(0, 0), other_seed.row_order(0, 0))


def test_tp_peers_identical_dp_ranks_different(tiny_data, monkeypatch):
    cfg = load_cfg(tiny_data)
    # webdataset-style splitters read the global RANK; ours must ignore it (TP peers differ in RANK).
    monkeypatch.setenv("RANK", "0")
    peer_a = data.ShardLoader(cfg, dp_rank=0, dp_size=2, batch_size=3)
    a = [peer_a.next_batch() for _ in range(5)]
    monkeypatch.setenv("RANK", "1")
    peer_b = data.ShardLoader(cfg, dp_rank=0, dp_size=2, batch_size=3)
    b = [peer_b.next_batch() for _ in range(5)]
    other = data.ShardLoader(cfg, dp_rank=1, dp_size=2, batch_size=3)
    c = [other.next_batch() for _ in range(5)]
    for loader in (peer_a, peer_b, other):
        loader.close()
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not any(np.array_equal(x, z) for x, z in zip(a, c))
    assert a[0].dtype == np.int64 and a[0].shape == (3, cfg.model.seq_len + 1)


def test_one_epoch_yields_every_row_once(tiny_data):
    cfg = load_cfg(tiny_data)
    rows = train_rows(cfg)
    batch = 4
    assert len(rows) % batch == 0
    loader = data.ShardLoader(cfg, dp_rank=0, dp_size=1, batch_size=batch, prefetch=3)
    seen = [r.tobytes() for _ in range(len(rows) // batch) for r in loader.next_batch()]
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["shard_cursor"] == 0
    loader.close()
    assert sorted(seen) == sorted(rows)
    assert seen != rows  # shuffled, not manifest order
    # a batch mixes the shard: its rows are not consecutive sequences of one packed sample
    index = {r: i for i, r in enumerate(rows)}
    per_sample = tiny_data.manifest["sequences_per_sample"]
    samples_per_batch = [len({index[r] // per_sample for r in seen[i : i + batch]}) for i in range(0, len(seen), batch)]
    assert sum(samples_per_batch) / len(samples_per_batch) > 0.9 * batch


def test_position_restores_exactly_across_shard_and_epoch_boundaries(tiny_data):
    cfg = load_cfg(tiny_data)
    rows_per_epoch = len(train_rows(cfg)) // 2  # DP=2: one rank's share
    batch = 3  # not a divisor of sequences_per_sample: positions land mid-sample
    first = data.ShardLoader(cfg, dp_rank=1, dp_size=2, batch_size=batch)
    stream = [first.next_batch() for _ in range(rows_per_epoch // batch + 4)]  # past one epoch
    first.close()
    for cut in (1, 7, rows_per_epoch // batch - 1, rows_per_epoch // batch + 1):
        loader = data.ShardLoader(cfg, dp_rank=1, dp_size=2, batch_size=batch)
        for _ in range(cut):
            loader.next_batch()
        state = json.loads(json.dumps(loader.state_dict()))  # what a checkpoint stores
        loader.close()
        resumed = data.ShardLoader(cfg, dp_rank=1, dp_size=2, batch_size=batch)
        resumed.load_state_dict(state)
        for i in range(cut, len(stream)):
            assert np.array_equal(resumed.next_batch(), stream[i]), f"cut {cut}: batch {i} differs"
        resumed.close()
    with pytest.raises(data.DataError, match="same number of data-parallel ranks"):
        data.ShardLoader(cfg, dp_rank=0, dp_size=1, batch_size=batch).load_state_dict(state)


def test_val_set_is_fixed_and_the_same_for_both_arms(tiny_data):
    prism = load_cfg(tiny_data, "train.val_tokens=2048")
    uniform = load_cfg(tiny_data, "train.val_tokens=2048", preset="tiny_uniform.yaml")
    a, b = data.load_val_tokens(prism), data.load_val_tokens(uniform)
    assert a.shape == (2048 // 128, 129) and np.array_equal(a, b)
    manifest = data.read_manifest(prism.data.dataset_dir)
    first = manifest["splits"]["val"]["shards"][0]
    shard = data.Shard(Path(prism.data.dataset_dir), first, manifest, manifest["splits"]["val"]["samples_per_shard"])
    assert np.array_equal(a[: len(shard.samples[0])], shard.samples[0])  # first rows, manifest/tar order


@pytest.fixture
def dataset_copy(tiny_data, tmp_path):
    dst = tmp_path / "ds"
    shutil.copytree(tiny_data.dataset_dir, dst)
    return dst


def test_refuses_corrupted_and_truncated_shards(tiny_data, dataset_copy):
    cfg = load_cfg(tiny_data, f"data.dataset_dir={dataset_copy}")
    manifest = data.read_manifest(dataset_copy)
    shards = manifest["splits"]["train"]["shards"]
    # same size, one byte flipped: caught by the hash when the shard is opened
    victim = dataset_copy / shards[0]["path"]
    raw = bytearray(victim.read_bytes())
    raw[-2000] ^= 0xFF
    victim.write_bytes(bytes(raw))
    loader = data.ShardLoader(cfg, dp_rank=0, dp_size=1, batch_size=4)
    with pytest.raises(data.DataError, match="sha256 does not match the manifest") as err:
        for _ in range(len(train_rows(load_cfg(tiny_data))) // 4):
            loader.next_batch()
    assert "\n" not in str(err.value) and victim.name in str(err.value)
    # truncated: caught by the size check at start-up, before any training
    other = dataset_copy / shards[1]["path"]
    other.write_bytes(other.read_bytes()[: other.stat().st_size // 2])
    with pytest.raises(data.DataError, match="truncated") as err:
        data.ShardLoader(cfg, dp_rank=0, dp_size=1, batch_size=4)
    assert other.name in str(err.value)


def test_refuses_mismatched_tokenizer_vocab_and_seq_len(tiny_data, tmp_path):
    with pytest.raises(data.DataError, match="seq_len=128 but model.seq_len=64"):
        data.check_compatible(data.read_manifest(tiny_data.dataset_dir), load_cfg(tiny_data, "model.seq_len=64"))
    vocab = data.read_manifest(tiny_data.dataset_dir)["tokenizer"]["vocab_size"]
    with pytest.raises(data.DataError, match=f"vocab_size={vocab} exceeds model.vocab_size=100"):
        data.check_compatible(data.read_manifest(tiny_data.dataset_dir), load_cfg(tiny_data, "model.vocab_size=100"))
    # another tokenizer file: refused by `prism train` itself, one line, exit 2
    other = tmp_path / "other-tokenizer.json"
    other.write_bytes(Path(tiny_data.tokenizer).read_bytes() + b" ")
    assert hashlib.sha256(other.read_bytes()).hexdigest() != hashlib.sha256(Path(tiny_data.tokenizer).read_bytes())
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline.cli",
            "train",
            str(ROOT / "configs/tiny_prism.yaml"),
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

"""The DP-aware shard loader on the real prepared tiny dataset: assignment, determinism, exact position
restore, the fixed val set, and the refusals (corrupt shard, tokenizer / vocab / seq_len mismatch). Then the
dataset format every reader shares (pipeline.dataset): the schema check, the verified shard reader, and that
the loader, `prism prepare --verify`, attention-distance and the demo all refuse a corrupted shard."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from data_prep.manifest import verify
from data_prep.tokenize_to_shards import encode_tar
from pipeline import config, data, dataset
from pipeline.dataset import DataError

ROOT = Path(__file__).resolve().parents[2]


def load_cfg(tiny_data, *extra: str, preset: str = "tiny_prism.yaml") -> config.Config:
    return config.load(ROOT / "configs" / preset, [*tiny_data.overrides, *extra])


def train_rows(cfg: config.Config) -> list[bytes]:
    """Every row of the train split, as bytes (for multiset comparisons)."""
    return [r.astype(np.int64).tobytes() for r in dataset.iter_rows(cfg.data.dataset_dir, "train")]


def test_dp_ranks_get_disjoint_equal_shards_every_epoch(tiny_data):
    cfg = load_cfg(tiny_data)
    n = len(dataset.read_manifest(cfg.data.dataset_dir)["splits"]["train"]["shards"])
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
    # another DP size is an elastic resume (tests/unit/test_loader_elastic.py), another seed is refused
    with pytest.raises(DataError, match="same run.seed"):
        data.ShardLoader(cfg, dp_rank=0, dp_size=1, batch_size=batch).load_state_dict({**state, "seed": 7})


def test_val_set_is_fixed_and_the_same_for_both_arms(tiny_data):
    prism = load_cfg(tiny_data, "train.val_tokens=2048")
    uniform = load_cfg(tiny_data, "train.val_tokens=2048", preset="tiny_uniform.yaml")
    a, b = data.load_val_tokens(prism), data.load_val_tokens(uniform)
    assert a.shape == (2048 // 128, 129) and np.array_equal(a, b)
    manifest = dataset.read_manifest(prism.data.dataset_dir)
    shard = dataset.read_shard(prism.data.dataset_dir, manifest, "val", manifest["splits"]["val"]["shards"][0])
    assert np.array_equal(a[: len(shard[0])], shard[0])  # first rows, manifest/tar order


@pytest.fixture
def dataset_copy(tiny_data, tmp_path):
    dst = tmp_path / "ds"
    shutil.copytree(tiny_data.dataset_dir, dst)
    return dst


def test_refuses_corrupted_and_truncated_shards(tiny_data, dataset_copy):
    cfg = load_cfg(tiny_data, f"data.dataset_dir={dataset_copy}")
    manifest = dataset.read_manifest(dataset_copy)
    shards = manifest["splits"]["train"]["shards"]
    # same size, one byte flipped: caught by the hash when the shard is opened
    victim = dataset_copy / shards[0]["path"]
    raw = bytearray(victim.read_bytes())
    raw[-2000] ^= 0xFF
    victim.write_bytes(bytes(raw))
    loader = data.ShardLoader(cfg, dp_rank=0, dp_size=1, batch_size=4)
    with pytest.raises(DataError, match="sha256 differs from the manifest") as err:
        for _ in range(len(train_rows(load_cfg(tiny_data))) // 4):
            loader.next_batch()
    assert "\n" not in str(err.value) and victim.name in str(err.value)
    # truncated: caught by the size check at start-up, before any training
    other = dataset_copy / shards[1]["path"]
    other.write_bytes(other.read_bytes()[: other.stat().st_size // 2])
    with pytest.raises(DataError, match="truncated") as err:
        data.ShardLoader(cfg, dp_rank=0, dp_size=1, batch_size=4)
    assert other.name in str(err.value)


def test_refuses_mismatched_vocab_and_seq_len(tiny_data):
    with pytest.raises(DataError, match="seq_len=128 but model.seq_len=64"):
        data.check_compatible(dataset.read_manifest(tiny_data.dataset_dir), load_cfg(tiny_data, "model.seq_len=64"))
    vocab = dataset.read_manifest(tiny_data.dataset_dir)["tokenizer"]["vocab_size"]
    with pytest.raises(DataError, match=f"vocab_size={vocab} exceeds model.vocab_size=100"):
        data.check_compatible(dataset.read_manifest(tiny_data.dataset_dir), load_cfg(tiny_data, "model.vocab_size=100"))


def test_refuses_an_eos_token_the_dataset_did_not_end_documents_with(tiny_data):
    """The manifest records the id prepare ended documents with; a run naming another data.eos_token would
    evaluate and export with a document end it never trained on."""
    manifest = dataset.read_manifest(tiny_data.dataset_dir)
    data.check_compatible(manifest, load_cfg(tiny_data))  # the token prepare used
    with pytest.raises(
        DataError, match=r"ends documents with '<\|endoftext\|>' \(token \d+\), not data.eos_token='the'"
    ):
        data.check_compatible(manifest, load_cfg(tiny_data, "data.eos_token=the"))


# --- the dataset format (pipeline.dataset) ----------------------------------------------------------------
def write_dataset(root: Path, seq_len: int = 8, sequences_per_sample: int = 2, samples_per_shard: int = 3):
    """A hand-made dataset in the on-disk format (2 train shards, 1 val shard of random tokens), written with
    data_prep's tar writer; returns the manifest and every split's rows in manifest order."""
    rng = np.random.default_rng(0)
    manifest = {
        "format_version": dataset.FORMAT_VERSION,
        "tokenizer": {"name_or_path": "tok.json", "vocab_size": 50, "eos_id": 0, "sha256": "0" * 64},
        "seq_len": seq_len,
        "dtype": "uint16",
        "sequences_per_sample": sequences_per_sample,
        "splits": {},
        "config": {},
    }
    rows = {}
    for split, count in (("train", 2), ("val", 1)):
        shards, arrays = [], []
        for index in range(count):
            samples = rng.integers(0, 50, (samples_per_shard, sequences_per_sample, seq_len + 1), dtype=np.uint16)
            tar = encode_tar(samples, dataset.shard_key(split, 0, index))
            path = dataset.shard_name(split, 0, index)
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            (root / path).write_bytes(tar)
            shards.append({"path": path, "samples": samples_per_shard, "sha256": hashlib.sha256(tar).hexdigest()})
            arrays.append(samples)
        manifest["splits"][split] = {"samples_per_shard": samples_per_shard, "shards": shards}
        rows[split] = np.concatenate(arrays).reshape(-1, seq_len + 1)
    (root / dataset.MANIFEST).write_text(json.dumps(manifest))
    return manifest, rows


def flip_token_byte(path: Path, offset: int = 512 + 3) -> None:
    """Flip one byte inside the first member's tokens: the tar stays readable, only the hash can tell."""
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0xFF
    path.write_bytes(bytes(raw))


def refusal(call, match: str) -> str:
    with pytest.raises(DataError, match=match) as err:
        call()
    assert "\n" not in str(err.value)
    return str(err.value)


def test_read_manifest_names_the_missing_or_bad_key(tmp_path):
    good, _ = write_dataset(tmp_path)
    assert dataset.read_manifest(tmp_path) == good

    cases = [
        (lambda m: m.pop("seq_len"), r"key seq_len is missing"),
        (lambda m: m["tokenizer"].pop("vocab_size"), r"key tokenizer\.vocab_size is missing"),
        (lambda m: m["splits"].pop("val"), r"key splits\.val is missing"),
        (
            lambda m: m["splits"]["train"]["shards"][1].pop("sha256"),
            r"key splits\.train\.shards\[1\]\.sha256 is missing",
        ),
        (
            lambda m: m["splits"]["val"].update(samples_per_shard=0),
            r"splits\.val\.samples_per_shard is 0, expected a positive integer",
        ),
        (lambda m: m.update(sequences_per_sample="2"), r"sequences_per_sample is '2', expected a positive integer"),
        (lambda m: m.update(dtype="float32"), r"dtype 'float32' is not one of uint16, uint32"),
        (lambda m: m.update(format_version=2), r"format_version 2 is not the one this prism reads \(1\)"),
    ]
    for edit, match in cases:
        m = json.loads(json.dumps(good))
        edit(m)
        (tmp_path / dataset.MANIFEST).write_text(json.dumps(m))
        assert "prism prepare CONFIG --overwrite" in refusal(lambda: dataset.read_manifest(tmp_path), match)
    (tmp_path / dataset.MANIFEST).write_text("{")
    refusal(lambda: dataset.read_manifest(tmp_path), "not valid JSON")
    refusal(lambda: dataset.read_manifest(tmp_path / "nowhere"), "no manifest; build the dataset")


def test_verified_rows_are_the_written_ones_and_a_corrupted_shard_is_refused(tmp_path):
    manifest, rows = write_dataset(tmp_path)
    for split in dataset.SPLITS:
        assert np.array_equal(np.stack(list(dataset.iter_rows(tmp_path, split))), rows[split])
    first = manifest["splits"]["train"]["shards"][0]
    flip_token_byte(tmp_path / first["path"])
    msg = refusal(lambda: dataset.read_shard(tmp_path, manifest, "train", first), "sha256 differs from the manifest")
    assert first["path"] in msg and "corrupt" in msg
    refusal(lambda: list(dataset.iter_rows(tmp_path, "train")), "sha256 differs")
    # Members checked too, not only the hash: a well-formed tar of the wrong sample size, manifest hash updated.
    samples = np.zeros((3, 2, 7), dtype=np.uint16)  # rows of 7 tokens, the manifest says seq_len + 1 = 9
    tar = encode_tar(samples, dataset.shard_key("train", 0, 0))
    (tmp_path / first["path"]).write_bytes(tar)
    entry = {**first, "sha256": hashlib.sha256(tar).hexdigest()}
    refusal(lambda: dataset.read_shard(tmp_path, manifest, "train", entry), r"member train-00000-000000-000000\.tok")


def test_attention_distance_reader_refuses_a_corrupted_shard(tmp_path):
    from pipeline.analysis.measure import count_sequences, iter_sequences

    manifest, rows = write_dataset(tmp_path)
    assert count_sequences(tmp_path, "val") == len(rows["val"])
    clean = list(iter_sequences(tmp_path, "val"))
    assert clean[0].dtype == np.int64 and np.array_equal(np.stack(clean), rows["val"])
    flip_token_byte(tmp_path / manifest["splits"]["val"]["shards"][0]["path"])
    refusal(lambda: next(iter_sequences(tmp_path, "val")), "sha256 differs from the manifest")


def test_demo_unigram_entropy_counts_the_predicted_tokens(tmp_path):
    from pipeline.demo import unigram_entropy

    _, rows = write_dataset(tmp_path)
    entropy, cross, tokens = unigram_entropy(tmp_path / dataset.MANIFEST)
    train = np.bincount(rows["train"][:, 1:].ravel(), minlength=50)
    val = np.bincount(rows["val"][:, 1:].ravel(), minlength=50)
    p = train[train > 0] / train.sum()
    smoothed = (train + 1) / (train.sum() + 50)
    assert tokens == rows["train"][:, 1:].size
    assert entropy == pytest.approx(-(p * np.log(p)).sum())
    assert cross == pytest.approx(-(val * np.log(smoothed)).sum() / val.sum())


def test_every_reader_refuses_a_corrupted_shard(tiny_data, dataset_copy):
    """Loader, `prism prepare --verify`, attention-distance and the demo read through one verified reader:
    a shard whose bytes no longer match its sha256 is refused by each of them, naming the shard."""
    from pipeline.analysis.measure import iter_sequences
    from pipeline.demo import unigram_entropy

    cfg = load_cfg(tiny_data, f"data.dataset_dir={dataset_copy}")
    manifest = dataset.read_manifest(dataset_copy)
    paths = [s["path"] for split in dataset.SPLITS for s in manifest["splits"][split]["shards"]]
    for path in paths:
        flip_token_byte(dataset_copy / path, offset=1024)  # a token byte inside the first member
    loader = data.ShardLoader(cfg, dp_rank=0, dp_size=1, batch_size=4)  # the start-up size check still passes
    readers = {
        "loader": loader.next_batch,
        "val set": lambda: data.load_val_tokens(cfg),
        "attention-distance": lambda: next(iter_sequences(dataset_copy, "val")),
        "demo": lambda: unigram_entropy(dataset_copy / dataset.MANIFEST),
    }
    for name, read in readers.items():
        msg = refusal(read, "sha256 differs from the manifest")
        assert any(path in msg for path in paths), name
    loader.close()
    problems = verify(dataset_copy)
    assert len(problems) == len(paths) and all("sha256 differs from the manifest" in p for p in problems)

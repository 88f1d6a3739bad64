"""Data prep without a build of its own: the session's `tiny_data` dataset (a datatrove run with tasks=2
over an 8-file FineWeb-schema corpus) against an independent re-tokenisation, its tar members, `prepare
--verify`, the refusals that come before any build, the executors, and the embedded corpus and tokenizer.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import sys
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer

from data_prep.build import build_executor, build_pipeline, prepare
from data_prep.corpus import FINEWEB_SCHEMA, build_embedded_corpus, train_bpe_tokenizer
from data_prep.manifest import verify
from data_prep.tokenize_to_shards import TokenizeToShards
from pipeline import cli, config
from pipeline.dataset import DataError

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny_prism.yaml"


def load(tiny_data, *extra: str) -> config.Config:
    return config.load(TINY, tiny_data.overrides + list(extra))


def read_samples(dataset_dir: Path, shard: dict, m: dict) -> list[np.ndarray]:
    shape = (m["sequences_per_sample"], m["seq_len"] + 1)
    with tarfile.open(dataset_dir / shard["path"]) as tar:
        members = tar.getmembers()
        return [np.frombuffer(tar.extractfile(t).read(), dtype=m["dtype"]).reshape(shape) for t in members]


def expected_streams(tiny_data, m: dict, tasks: int) -> dict[tuple[int, str], tuple[np.ndarray, list[str]]]:
    """Independent re-tokenisation: per (rank, split), the EOS-joined token stream and its documents."""
    tok = Tokenizer.from_file(str(tiny_data.tokenizer))
    tok.encode_special_tokens = True
    eos = m["tokenizer"]["eos_id"]
    frac = m["config"]["data.val_fraction"]
    files = sorted(tiny_data.corpus_dir.glob("*.parquet"))
    out = {}
    for rank in range(tasks):
        docs = {"train": [], "val": []}
        for f in files[rank::tasks]:  # datatrove's ParquetReader: whole files, round-robin over ranks
            t = pq.read_table(f)
            for doc_id, text in zip(t.column("id").to_pylist(), t.column("text").to_pylist()):
                h = int.from_bytes(hashlib.sha256(doc_id.encode()).digest()[:8], "big")
                docs["val" if h < frac * 2**64 else "train"].append(text)
        for split, texts in docs.items():
            ids = [np.array(e.ids + [eos]) for e in tok.encode_batch(texts, add_special_tokens=False)]
            out[rank, split] = (np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64), texts)
    return out


# --- the fixture dataset (tasks=2) ----------------------------------------------------------------------
def test_tasks2_dataset_matches_an_independent_tokenisation(tiny_data):
    m, root = tiny_data.manifest, tiny_data.dataset_dir
    assert m["tasks"] == 2 and m["dtype"] == "uint16" and m["seq_len"] == 128
    tok = Tokenizer.from_file(str(tiny_data.tokenizer))
    eos = m["tokenizer"]["eos_id"]
    assert eos == tok.token_to_id("<|endoftext|>")
    expected = expected_streams(tiny_data, m, tasks=2)

    encoded = sum(len(stream) for stream, _ in expected.values())
    t = m["totals"]
    assert t["tokens_written"] + t["tokens_dropped"] == t["tokens_encoded"] == encoded
    assert t["documents"] == sum(len(texts) for _, texts in expected.values())
    assert t["documents"] == pq.ParquetDataset(tiny_data.corpus_dir).read(columns=["id"]).num_rows

    seen_texts = {"train": set(), "val": set()}
    for split in ("train", "val"):
        per_shard = m["splits"][split]["samples_per_shard"]
        assert m["splits"][split]["shards"], f"no {split} shards"
        for rank in range(2):
            shards = [s for s in m["splits"][split]["shards"] if s["path"].startswith(f"{split}/shard-{rank:05d}-")]
            assert [s["path"] for s in shards] == [f"{split}/shard-{rank:05d}-{i:06d}.tar" for i in range(len(shards))]
            rows = []
            for s in shards:
                samples = read_samples(root, s, m)
                assert len(samples) == s["samples"] == per_shard
                assert s["tokens"] == per_shard * m["sequences_per_sample"] * 129
                rows += [r for sample in samples for r in sample]
            written = np.concatenate(rows).astype(np.int64) if rows else np.zeros(0, dtype=np.int64)
            stream, texts = expected[rank, split]
            # End-of-task rule: what is written is a prefix of the task's stream; less than a shard is dropped.
            assert np.array_equal(written, stream[: len(written)])
            assert len(stream) - len(written) < per_shard * m["sequences_per_sample"] * 129
            # Every complete document decodes back to its original text, in order.
            pieces = np.split(written, np.flatnonzero(written == eos) + 1)[:-1]
            for piece, text in zip(pieces, texts):
                assert tok.decode(piece[:-1].tolist(), skip_special_tokens=False) == text
            seen_texts[split].update(texts[: len(pieces)])
    assert seen_texts["val"] and not (seen_texts["train"] & seen_texts["val"])
    assert verify(root) == []


def test_tar_members_are_webdataset_samples(tiny_data):
    import webdataset as wds

    m, root = tiny_data.manifest, tiny_data.dataset_dir
    shard = m["splits"]["val"]["shards"][0]
    samples = list(wds.WebDataset(str(root / shard["path"]), shardshuffle=False))
    assert len(samples) == m["splits"]["val"]["samples_per_shard"]
    assert all("." not in s["__key__"] and set(s) >= {"__key__", "tokens"} for s in samples)
    assert len(samples[0]["tokens"]) == m["sequences_per_sample"] * (m["seq_len"] + 1) * 2
    with tarfile.open(root / shard["path"]) as tar:
        assert {(t.mtime, t.uid, t.gid, t.uname) for t in tar.getmembers()} == {(0, 0, 0, "prism")}


# --- refusals -------------------------------------------------------------------------------------------
def one_line_refusal(cfg: config.Config, match: str, **kw) -> str:
    with pytest.raises(DataError, match=match) as e:
        prepare(cfg, **kw)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_refuses_bad_input(tiny_data, tmp_path):
    d = f"data.dataset_dir={tmp_path / 'out'}", "data.input_format=parquet"  # embedded would build it
    one_line_refusal(load(tiny_data, *d, f"data.input={tmp_path / 'nowhere'}"), "path not found")
    (tmp_path / "empty").mkdir()
    one_line_refusal(load(tiny_data, *d, f"data.input={tmp_path / 'empty'}"), "no parquet files")
    (tmp_path / "notext").mkdir()
    pq.write_table(pa.table({"content": ["hello world"], "id": ["a"]}), tmp_path / "notext" / "x.parquet")
    msg = one_line_refusal(load(tiny_data, *d, f"data.input={tmp_path / 'notext'}"), "no column 'text'")
    assert "data.text_key" in msg
    one_line_refusal(load(tiny_data, *d, f"data.tokenizer={tmp_path / 'missing.json'}"), "tokenizer file not found")
    one_line_refusal(load(tiny_data, *d, "model.vocab_size=4096"), "model.vocab_size=4096 is smaller")
    assert not (tmp_path / "out").exists()  # nothing written by a refused run


def test_refuses_hub_tokenizer_offline(tiny_data, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # empty cache
    msg = one_line_refusal(load(tiny_data, f"data.dataset_dir={tmp_path}/o", "data.tokenizer=gpt2"), "Hub")
    assert "pass a local tokenizer.json" in msg


def test_verify_reports_shards_that_do_not_match(tiny_data, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_data.dataset_dir, copy)
    assert cli.main(["prepare", "--verify", str(copy)]) == 0
    shards = tiny_data.manifest["splits"]["train"]["shards"]
    corrupt = copy / shards[0]["path"]
    data = bytearray(corrupt.read_bytes())
    data[1024] ^= 0xFF  # a token byte inside the first member
    corrupt.write_bytes(bytes(data))
    (copy / shards[1]["path"]).unlink()
    truncated = copy / shards[2]["path"]
    with tarfile.open(truncated) as tar:
        first = tar.getmembers()[0]
        body = tar.extractfile(first).read()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:  # a shard with one sample instead of 16
        tar.addfile(first, io.BytesIO(body))
    truncated.write_bytes(buf.getvalue())
    shutil.copy(copy / shards[3]["path"], copy / "train" / "shard-00009-000000.tar")
    capsys.readouterr()
    assert cli.main(["prepare", "--verify", str(copy)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"prism prepare: error: {copy}: manifest does not match its shards")
    line = {shard["path"]: [x for x in err if f"{shard['path']}:" in x] for shard in shards[:4]}
    assert len(line[shards[0]["path"]]) == 1 and "sha256 differs from the manifest" in line[shards[0]["path"]][0]
    assert len(line[shards[1]["path"]]) == 1 and f"{shards[1]['path']}: missing" in line[shards[1]["path"]][0]
    assert len(line[shards[2]["path"]]) == 1 and "1 samples, manifest says 16" in line[shards[2]["path"]][0]
    assert line[shards[3]["path"]] == []  # the intact one
    assert "train/shard-00009-000000.tar: shard file not listed in the manifest" in [x.strip() for x in err]


# --- executors, inputs ------------------------------------------------------------------------------------
def test_slurm_executor_wraps_the_same_pipeline(tiny_data, tmp_path):
    from datatrove.executor import LocalPipelineExecutor, SlurmPipelineExecutor

    cfg = load(
        tiny_data,
        "data.executor=slurm",
        "data.slurm.partition=cpu",
        "data.tasks=4",
        "data.workers=2",
        "data.slurm.time=01:00:00",
        "data.slurm.cpus_per_task=3",
    )
    ident = {"data.samples_per_shard": 16, "data.val_samples_per_shard": 2, "dtype": "uint16"}
    pipeline = build_pipeline(cfg, str(tiny_data.tokenizer), ident, 7)
    slurm = build_executor(cfg, pipeline, tmp_path / "logs")
    assert isinstance(slurm, SlurmPipelineExecutor) and slurm.pipeline is pipeline
    assert isinstance(pipeline[1], TokenizeToShards) and pipeline[1].eos_id == 7
    assert pipeline[1].eos_token is None  # datatrove's EOS post-processor is off: the packer appends EOS
    assert pipeline[1].encode_threads is None  # each Slurm task has its own cpus_per_task
    script = slurm.get_launch_file_contents(slurm.get_sbatch_args(max_array=4), "launch_pickled_pipeline x.pik")
    for line in ("--partition=cpu", "--array=0-3%2", "--cpus-per-task=3", "--time=01:00:00"):
        assert f"#SBATCH {line}" in script
    assert f"source {sys.prefix}/bin/activate" in script
    local = build_executor(load(tiny_data), pipeline, tmp_path / "logs2")
    assert isinstance(local, LocalPipelineExecutor) and local.pipeline is pipeline and local.start_method == "fork"
    with pytest.raises(DataError, match="data.slurm.partition"):
        build_executor(load(tiny_data, "data.executor=slurm"), pipeline, tmp_path / "logs3")


def test_local_tasks_side_by_side_split_the_cores(tiny_data, monkeypatch):
    from data_prep.executor import encode_threads

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    threads = {
        (tasks, workers): encode_threads(load(tiny_data, f"data.tasks={tasks}", f"data.workers={workers}"))
        for tasks, workers in ((1, -1), (2, 1), (2, -1), (4, -1), (4, 2), (3, -1), (16, -1), (16, 8))
    }
    assert threads == {
        (1, -1): None,  # one task at a time: the tokenizer's every-core default
        (2, 1): None,
        (2, -1): 4,
        (4, -1): 2,
        (4, 2): 4,  # two workers run the four tasks two at a time
        (3, -1): 2,
        (16, -1): 1,
        (16, 8): 1,
    }


def test_writer_sizes_the_tokenizer_pool_of_its_task_and_appends_eos_itself(tiny_data, tmp_path, monkeypatch):
    """A task run in this process: encode_threads becomes RAYON_NUM_THREADS before the tokenizer first encodes
    (a value the user set wins), and every document ends with exactly one EOS, appended by the packer."""
    from datatrove.data import Document

    from data_prep.manifest import rank_record

    monkeypatch.delenv("RAYON_NUM_THREADS", raising=False)
    tok = Tokenizer.from_file(str(tiny_data.tokenizer))
    eos = tok.token_to_id("<|endoftext|>")
    writer = TokenizeToShards(
        str(tmp_path),
        str(tiny_data.tokenizer),
        eos,
        8,
        1,
        {"train": 1, "val": 1},
        0.0,
        "uint16",
        batch_size=2,
        encode_threads=1,
    )
    texts = ["one two three", "four", "five six", "seven eight nine ten"]
    list(writer.run(iter(Document(text=t, id=str(i)) for i, t in enumerate(texts)), rank=0, world_size=1))
    assert os.environ["RAYON_NUM_THREADS"] == "1"
    expected = np.concatenate([np.array(tok.encode(t, add_special_tokens=False).ids + [eos]) for t in texts])
    record = json.loads(rank_record(tmp_path, 0).read_text())["train"]
    assert record["tokens_encoded"] == len(expected) and record["documents"] == len(texts)
    shape = {"sequences_per_sample": 1, "seq_len": 8, "dtype": "uint16"}
    written = [s.ravel() for shard in record["shards"] for s in read_samples(tmp_path, shard, shape)]
    assert len(written) == len(expected) // 9 == 2  # whole shards of one 9-token row each; the rest is dropped
    assert np.array_equal(np.concatenate(written), expected[:18])

    monkeypatch.setenv("RAYON_NUM_THREADS", "5")
    list(writer.run(iter([Document(text="x", id="0")]), rank=0, world_size=1))
    assert os.environ["RAYON_NUM_THREADS"] == "5"


def test_reader_yields_text_and_id_only(tiny_data):
    """FineWeb rows carry url, dump, date, language...: the reader reads neither those columns nor adds a
    file_path to each document; the writer uses text and id alone."""
    reader = build_pipeline(load(tiny_data), str(tiny_data.tokenizer), {"dtype": "uint16"}, 0)[0]
    docs = list(reader.run(None, 0, 1))
    assert len(docs) > 0 and all(d.metadata == {} and d.text and d.id for d in docs)
    assert len(pq.read_schema(sorted(tiny_data.corpus_dir.glob("*.parquet"))[0]).names) > 2


def test_embedded_corpus_and_tokenizer_are_reproducible(tmp_path):
    a = build_embedded_corpus(tmp_path / "a", max_bytes=400_000, num_files=3)
    b = build_embedded_corpus(tmp_path / "b", max_bytes=400_000, num_files=3)
    files = sorted(p.name for p in a.iterdir())
    assert files == ["corpus-00000.parquet", "corpus-00001.parquet", "corpus-00002.parquet"]
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files)
    schema = pq.read_schema(a / files[0])
    assert [(f.name, str(f.type)) for f in schema] == [(n, t.replace("float64", "double")) for n, t in FINEWEB_SCHEMA]
    table = pq.ParquetDataset(a).read()
    assert table.num_rows >= 3 and sum(len(t) for t in table.column("text").to_pylist()) >= 400_000 * 0.9
    assert len(set(table.column("id").to_pylist())) == table.num_rows
    t1 = train_bpe_tokenizer(a, tmp_path / "t1.json", vocab_size=1024, eos_token="<|endoftext|>")
    t2 = train_bpe_tokenizer(b, tmp_path / "t2.json", vocab_size=1024, eos_token="<|endoftext|>")
    assert t1.read_bytes() == t2.read_bytes()
    tok = Tokenizer.from_file(str(t1))
    assert tok.get_vocab_size() == 1024 and tok.token_to_id("<|endoftext|>") == 0
    text = table.column("text")[0].as_py()
    assert tok.decode(tok.encode(text).ids) == text


def test_shard_bytes_equal_webdataset_tarwriter_output():
    from webdataset import TarWriter

    from data_prep.tokenize_to_shards import encode_tar

    samples = np.arange(3 * 4 * 9, dtype=np.uint16).reshape(3, 4, 9)
    buf = io.BytesIO()
    with TarWriter(buf, user="prism", group="prism", mtime=0, encoder=False) as tar:
        for i, sample in enumerate(samples):
            tar.write({"__key__": f"train-00000-000000-{i:06d}", "tokens": sample.tobytes()})
    assert encode_tar(samples, "train-00000-000000") == buf.getvalue()


def test_prism_steps_skip_datatroves_package_scan(monkeypatch, tmp_path):
    """The scan reads every installed distribution's metadata per step and process; an empty
    _requires_dependencies on a subclass does not stop it (datatrove chains the lists of the whole MRO)."""
    import datatrove.pipeline.base as base

    from data_prep.steps import PrismJsonlReader, PrismParquetReader
    from data_prep.tokenize_to_shards import TokenizeToShards

    def scan(step_name, required):
        raise AssertionError(f"{step_name} ran datatrove's package scan for {list(required)}")

    monkeypatch.setattr(base, "check_required_dependencies", scan)
    PrismParquetReader(str(tmp_path))
    PrismJsonlReader(str(tmp_path))
    TokenizeToShards(str(tmp_path), "gpt2", 50256, 16, 1, {"train": 1, "val": 1}, 0.1, "uint16")
    with pytest.raises(AssertionError, match="package scan"):  # what a plain datatrove step does
        from datatrove.pipeline.readers import ParquetReader

        ParquetReader(str(tmp_path))

"""The dataset format: what data_prep writes and every reader (loader, verify, analysis, demo) reads.

A dataset folder holds ``manifest.json`` and ``<split>/shard-RRRRR-NNNNNN.tar`` (RRRRR = datatrove rank,
NNNNNN = shard within that rank). Each tar member ``<key>.tokens`` is one sample: ``sequences_per_sample``
rows of ``seq_len + 1`` little-endian tokens (inputs + targets), C-order. The manifest lists every shard with
its sha256; readers go through ``read_manifest`` (schema-checked) and ``read_shard`` (hash and members
checked), so a corrupted or foreign dataset is refused with one line wherever it is read.

Imports only numpy, the standard library and pipeline.config: data_prep and pipeline.data import this.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.config import ConfigError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "val")
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
SAMPLE_SUFFIX = ".tokens"
SHARD_GLOB = "shard-*.tar"
REBUILD = "rebuild it with `prism prepare CONFIG --overwrite`"


class DataError(ConfigError):
    """A dataset that cannot be used as asked (one line: what is wrong and how to fix it)."""


def eos_id(tokenizer: Any, eos_token: str, where: str | Path) -> int:
    """The id of ``eos_token`` (data.eos_token) in a loaded tokenizer: the one lookup, for `prism prepare`
    (the id the shards end documents with, recorded in the manifest), the compatibility check and eval."""
    found = tokenizer.token_to_id(eos_token)
    if found is None:
        raise DataError(f"data.eos_token={eos_token!r} is not in the tokenizer {where}; set data.eos_token")
    return found


# --- names ----------------------------------------------------------------------------------------------
def shard_name(split: str, rank: int, index: int) -> str:
    """Path of a shard relative to the dataset folder."""
    return f"{split}/shard-{rank:05d}-{index:06d}.tar"


def shard_key(split: str, rank: int, index: int) -> str:
    """Prefix of the shard's sample keys (webdataset keys hold no dots)."""
    return f"{split}-{rank:05d}-{index:06d}"


def dtype_for_vocab(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 2**16 else "uint32"


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


# --- manifest -------------------------------------------------------------------------------------------
def read_manifest(dataset_dir: str | Path) -> dict[str, Any]:
    """manifest.json, with every key a reader uses checked; a missing or bad key is named in one DataError."""
    path = Path(dataset_dir) / MANIFEST
    if not path.is_file():
        raise DataError(f"{path}: no manifest; build the dataset with `prism prepare CONFIG` first")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: not valid JSON ({e}); {REBUILD}") from None

    def need(obj: dict, key: str, kind: type, name: str, positive: bool = False) -> Any:
        if key not in obj:
            raise DataError(f"{path}: key {name} is missing; {REBUILD}")
        value = obj[key]
        if not isinstance(value, kind) or isinstance(value, bool) or (positive and value < 1):
            expected = {int: "a positive integer" if positive else "an integer", str: "a string"}.get(
                kind, kind.__name__
            )
            raise DataError(f"{path}: {name} is {value!r}, expected {expected}; {REBUILD}")
        return value

    if (version := need(manifest, "format_version", int, "format_version")) != FORMAT_VERSION:
        raise DataError(
            f"{path}: format_version {version} is not the one this prism reads ({FORMAT_VERSION}); {REBUILD}"
        )
    if (dtype := need(manifest, "dtype", str, "dtype")) not in DTYPES:
        raise DataError(f"{path}: dtype {dtype!r} is not one of {', '.join(DTYPES)}; {REBUILD}")
    need(manifest, "seq_len", int, "seq_len", positive=True)
    need(manifest, "sequences_per_sample", int, "sequences_per_sample", positive=True)
    need(manifest, "config", dict, "config")
    tokenizer = need(manifest, "tokenizer", dict, "tokenizer")
    need(tokenizer, "name_or_path", str, "tokenizer.name_or_path")
    need(tokenizer, "vocab_size", int, "tokenizer.vocab_size", positive=True)
    need(tokenizer, "eos_id", int, "tokenizer.eos_id")
    need(tokenizer, "sha256", str, "tokenizer.sha256")
    splits = need(manifest, "splits", dict, "splits")
    for split in SPLITS:
        info = need(splits, split, dict, f"splits.{split}")
        need(info, "samples_per_shard", int, f"splits.{split}.samples_per_shard", positive=True)
        for i, shard in enumerate(need(info, "shards", list, f"splits.{split}.shards")):
            name = f"splits.{split}.shards[{i}]"
            if not isinstance(shard, dict):
                raise DataError(f"{path}: {name} is {shard!r}, expected an object; {REBUILD}")
            need(shard, "path", str, f"{name}.path")
            need(shard, "sha256", str, f"{name}.sha256")
            need(shard, "samples", int, f"{name}.samples")
    return manifest


def sample_bytes(manifest: dict[str, Any]) -> int:
    """Bytes of one tar member: ``sequences_per_sample x (seq_len + 1)`` tokens."""
    return manifest["sequences_per_sample"] * (manifest["seq_len"] + 1) * DTYPES[manifest["dtype"]].itemsize


# --- verified rows --------------------------------------------------------------------------------------
def read_shard(dataset_dir: str | Path, manifest: dict[str, Any], split: str, entry: dict[str, Any]) -> np.ndarray:
    """One shard, checked against its manifest entry, as ``[samples, sequences_per_sample, seq_len + 1]``.

    Checked: the file exists, its sha256 matches, it is a tar of ``.tokens`` members of one sample's size,
    as many as the manifest says. Every problem found goes into one DataError line.
    """
    path = Path(dataset_dir) / entry["path"]
    if not path.is_file():
        raise DataError(f"{path}: missing, though the manifest lists it; {REBUILD}")
    data = path.read_bytes()
    problems = []

    def corrupt(found: list[str]) -> DataError:
        return DataError(f"{path}: {'; '.join(found)}; the shard is corrupt, {REBUILD}")

    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        problems.append("sha256 differs from the manifest")
    dtype, size = DTYPES[manifest["dtype"]], sample_bytes(manifest)
    shape = (manifest["sequences_per_sample"], manifest["seq_len"] + 1)
    samples = []
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            members = tar.getmembers()
    except tarfile.TarError as e:
        raise corrupt([*problems, f"not a readable tar ({e})"]) from None
    for member in members:
        if not member.isfile() or member.size != size or not member.name.endswith(SAMPLE_SUFFIX):
            problems.append(
                f"member {member.name} is not {size} bytes of {SAMPLE_SUFFIX} ({shape[0]}x{shape[1]} {dtype})"
            )
            break
        samples.append(np.frombuffer(data, dtype=dtype, count=shape[0] * shape[1], offset=member.offset_data))
    per_shard = manifest["splits"][split]["samples_per_shard"]
    if len(members) != entry["samples"] or entry["samples"] != per_shard:
        problems.append(f"{len(members)} samples, manifest says {entry['samples']} (samples_per_shard {per_shard})")
    if problems:
        raise corrupt(problems)
    return np.stack(samples).reshape(len(samples), *shape)


def iter_shards(dataset_dir: str | Path, split: str, manifest: dict[str, Any] | None = None) -> Iterator[np.ndarray]:
    """Every shard of a split in manifest order, each verified by ``read_shard`` before it is handed out."""
    manifest = manifest if manifest is not None else read_manifest(dataset_dir)
    if split not in manifest["splits"]:
        raise DataError(f"{Path(dataset_dir) / MANIFEST}: no {split!r} split (it has {', '.join(manifest['splits'])})")
    for entry in manifest["splits"][split]["shards"]:
        yield read_shard(dataset_dir, manifest, split, entry)


def iter_rows(dataset_dir: str | Path, split: str, manifest: dict[str, Any] | None = None) -> Iterator[np.ndarray]:
    """Packed ``[seq_len + 1]`` rows of a split in manifest and tar order (no shuffle), verified shard by shard."""
    for shard in iter_shards(dataset_dir, split, manifest):
        yield from shard.reshape(-1, shard.shape[-1])

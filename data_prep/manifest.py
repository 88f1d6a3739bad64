"""manifest.json: assembled from the per-rank records once every task finished; verified by re-hashing.

The folder's state lives in ``<dataset_dir>/.prep/``: ``state.json`` (the data identity and task count, written
before any task starts), ``ranks/RRRRR.json`` (one per finished task) and datatrove's ``logs/`` (completions,
stats, per-task logs). manifest.json is written last, via temp + rename, and holds nothing time-dependent, so a
killed-and-resumed build yields the same bytes as a clean one.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path
from typing import Any

import numpy as np

from data_prep.steps import SPLITS
from pipeline.atomic import write_atomic
from pipeline.config import ConfigError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
STATE = ".prep/state.json"


class DatasetError(ConfigError):
    """A dataset folder that cannot be used as asked (one line: what and how to fix it)."""


def data_hash(identity: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def first_difference(old: dict[str, Any], new: dict[str, Any]) -> str | None:
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key):
            return f"{key} (was {old.get(key)!r}, now {new.get(key)!r})"
    return None


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DatasetError(f"{path}: unreadable ({e}); rebuild with prism prepare --overwrite") from None


def _datatrove_stats(logs_dir: Path, tasks: int) -> list[dict[str, Any]]:
    """Per-step counters summed over tasks, without timings (those differ run to run)."""
    from datatrove.utils.stats import PipelineStats

    total = PipelineStats()
    for rank in range(tasks):
        path = logs_dir / "stats" / f"{rank:05d}.json"
        if path.is_file():
            total = total + PipelineStats.from_json(json.loads(path.read_text()))
    steps = json.loads(total.to_json())
    for step in steps:
        step.pop("time_stats", None)
    return steps


def write_manifest(dataset_dir: Path) -> Path:
    state = read_json(dataset_dir / STATE)
    tasks = state["tasks"]
    records = []
    for rank in range(tasks):
        path = dataset_dir / ".prep" / "ranks" / f"{rank:05d}.json"
        if not path.is_file():
            raise DatasetError(
                f"{dataset_dir}: task {rank} of {tasks} has not finished; rerun prism prepare to resume it"
            )
        records.append(read_json(path))
    ident = state["identity"]
    per_shard = {"train": ident["data.samples_per_shard"], "val": ident["data.val_samples_per_shard"]}
    splits, totals = {}, {"documents": 0, "tokens_encoded": 0, "tokens_written": 0, "tokens_dropped": 0}
    for split in SPLITS:
        shards = [s for r in records for s in r[split]["shards"]]  # rank order, then shard order
        part = {k: sum(r[split][k] for r in records) for k in totals}
        splits[split] = {
            "samples_per_shard": per_shard[split],
            "shards": shards,
            "documents": part["documents"],
            "tokens_written": part["tokens_written"],
            "tokens_dropped": part["tokens_dropped"],
        }
        for k in totals:
            totals[k] += part[k]
    totals["shards"] = sum(len(s["shards"]) for s in splits.values())
    manifest = {
        "format_version": FORMAT_VERSION,
        "tokenizer": state["tokenizer"],
        "seq_len": ident["model.seq_len"],
        "dtype": ident["dtype"],
        "sequences_per_sample": ident["data.sequences_per_sample"],
        "splits": splits,
        "totals": totals,
        "datatrove_stats": _datatrove_stats(dataset_dir / ".prep" / "logs", tasks),
        "tasks": tasks,
        "config_hash": data_hash(ident),
        "config": ident,
        "end_of_task_rule": "only whole shards are written; a task's remaining tokens are dropped and counted",
    }
    path = dataset_dir / MANIFEST
    write_atomic(path, (json.dumps(manifest, indent=1) + "\n").encode())
    return path


def verify(dataset_dir: str | Path) -> list[str]:
    """Re-hash every shard and check its members against the manifest; returns the problems found."""
    root = Path(dataset_dir)
    if not (root / MANIFEST).is_file():
        raise DatasetError(f"{root}: no {MANIFEST}; build the dataset with prism prepare CONFIG first")
    m = read_json(root / MANIFEST)
    problems: list[str] = []
    itemsize = np.dtype(m["dtype"]).itemsize
    member_bytes = m["sequences_per_sample"] * (m["seq_len"] + 1) * itemsize
    listed = set()
    for split in SPLITS:
        per_shard = m["splits"][split]["samples_per_shard"]
        for shard in m["splits"][split]["shards"]:
            listed.add(shard["path"])
            path = root / shard["path"]
            if not path.is_file():
                problems.append(f"{shard['path']}: missing")
                continue
            data = path.read_bytes()
            if hashlib.sha256(data).hexdigest() != shard["sha256"]:
                problems.append(f"{shard['path']}: sha256 differs from the manifest")
            try:
                with tarfile.open(fileobj=io.BytesIO(data)) as tar:
                    members = tar.getmembers()
            except tarfile.TarError as e:
                problems.append(f"{shard['path']}: not a readable tar ({e})")
                continue
            bad = [t.name for t in members if t.size != member_bytes or not t.name.endswith(".tokens")]
            if bad:
                problems.append(f"{shard['path']}: member {bad[0]} is not {member_bytes} bytes of tokens")
            if len(members) != shard["samples"] or shard["samples"] != per_shard:
                problems.append(
                    f"{shard['path']}: {len(members)} samples, manifest says {shard['samples']} "
                    f"(samples_per_shard {per_shard})"
                )
        extra = sorted(
            p.relative_to(root).as_posix()
            for p in (root / split).glob("shard-*.tar")
            if p.relative_to(root).as_posix() not in listed
        )
        problems += [f"{p}: shard file not listed in the manifest" for p in extra]
    return problems

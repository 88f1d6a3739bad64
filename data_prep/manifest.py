"""manifest.json: assembled from the per-rank records once every task finished; verified by re-reading.

The folder's build state lives in ``<dataset_dir>/.prep/``: ``state.json`` (the data identity and task count,
written before any task starts), ``ranks/RRRRR.json`` (one per finished task) and datatrove's ``logs/``
(completions, stats, per-task logs). manifest.json is written last, via temp + rename, and holds nothing
time-dependent, so a killed-and-resumed build yields the same bytes as a clean one.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from datatrove.data import DocumentsPipeline
from datatrove.pipeline.base import PipelineStep

from pipeline.atomic import write_atomic
from pipeline.dataset import FORMAT_VERSION, MANIFEST, SHARD_GLOB, SPLITS, DataError, read_manifest, read_shard

PREP = ".prep"  # build state; readers never look inside
STATE = f"{PREP}/state.json"


def rank_record(dataset_dir: Path, rank: int) -> Path:
    """Where a finished task leaves its shard list and counts."""
    return dataset_dir / PREP / "ranks" / f"{rank:05d}.json"


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
        raise DataError(f"{path}: unreadable ({e}); rebuild with prism prepare --overwrite") from None


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
        path = rank_record(dataset_dir, rank)
        if not path.is_file():
            raise DataError(f"{dataset_dir}: task {rank} of {tasks} has not finished; rerun prism prepare to resume it")
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
        "datatrove_stats": _datatrove_stats(dataset_dir / PREP / "logs", tasks),
        "tasks": tasks,
        "config_hash": data_hash(ident),
        "config": ident,
        "end_of_task_rule": "only whole shards are written; a task's remaining tokens are dropped and counted",
    }
    path = dataset_dir / MANIFEST
    write_atomic(path, (json.dumps(manifest, indent=1) + "\n").encode())
    return path


def verify(dataset_dir: str | Path) -> list[str]:
    """Re-read every shard the way the loader does (hash, members, counts); returns the problems found."""
    root = Path(dataset_dir)
    manifest = read_manifest(root)
    problems: list[str] = []
    for split in SPLITS:
        listed = {shard["path"] for shard in manifest["splits"][split]["shards"]}
        for entry in manifest["splits"][split]["shards"]:
            try:
                read_shard(root, manifest, split, entry)
            except DataError as e:
                problems.append(str(e))
        extra = sorted(p.relative_to(root).as_posix() for p in (root / split).glob(SHARD_GLOB))
        problems += [f"{p}: shard file not listed in the manifest" for p in extra if p not in listed]
    return problems


class WriteManifest(PipelineStep):
    """One-task step run after all shard tasks (a dependent Slurm job): assembles manifest.json."""

    name = "📜 Write manifest"
    type = "✍️ - WRITER"

    def __init__(self, dataset_dir: str):
        super().__init__()
        self.dataset_dir = str(dataset_dir)

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        write_manifest(Path(self.dataset_dir))
        return
        yield  # a generator, like every datatrove step; it passes nothing on

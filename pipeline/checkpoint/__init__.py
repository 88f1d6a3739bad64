"""Checkpoints: the layout on disk, its integrity record, and reading weights back.

Layout: ``<checkpoint_dir>/step-0000123/`` holds DeepSpeed's ``mp_rank_XX_model_states.pt`` (its "module"
entry is the model state dict; our client state rides along inside it) and ZeRO ``*_optim_states.pt``,
plus ``config.yaml`` and ``integrity.json`` (every file's size and sha256, written last, atomically).
``<checkpoint_dir>/latest`` names the newest complete tag; it is replaced (temp + rename) only after every rank
has finished writing and the integrity record is on disk, so a checkpoint killed half-way is never picked up.

Client state: ``{"tokens_seen", "run_id", "prism": {"step", "ranks", "skips"}}``. DeepSpeed writes it
only from DP rank 0, so the per-rank parts of the train state (loader position, RNG states) are gathered to
every rank first and stored as one list indexed by global rank.

The package's rooms: this file (names, ``latest``, the integrity record, reading weights: what every reader
needs), `restore` (where a run resumes, what a resume may change, the train state, loading), `commit` (writing
a tag and the one commit order: integrity record, then ``latest``, then pruning), `writer` (synchronous or
background saves), `plan` (`prism plan`'s checkpoint lines), `reshard` (loading at another TP or DP size).
Submodules import this file; it imports none of them.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.atomic import write_atomic
from pipeline.config import ConfigError

LATEST = "latest"
CONFIG_NAME = "config.yaml"
INTEGRITY = "integrity.json"  # {"files": {name: {"size", "sha256"}}, "step", "tp", "dp_size", "world_size"}


def model_states_file(tp_rank: int) -> str:
    """DeepSpeed's file of one TP rank's weights: TP=N writes mp_rank_00 .. mp_rank_N-1."""
    return f"mp_rank_{tp_rank:02d}_model_states.pt"


MODEL_STATES = model_states_file(0)


def tag_for(step: int) -> str:
    return f"step-{step:07d}"


def config_file(tag_dir: Path) -> Path:
    """The config the checkpoint was trained with."""
    return Path(tag_dir) / CONFIG_NAME


# --- where checkpoints are -------------------------------------------------------------------------------
def read_latest(checkpoint_dir: Path) -> str | None:
    """What ``<checkpoint_dir>/latest`` says, unchecked (None without the file): the pointer's one reader."""
    pointer = Path(checkpoint_dir) / LATEST
    return pointer.read_text().strip() if pointer.is_file() else None


def latest_tag(checkpoint_dir: Path) -> str | None:
    """The tag ``<checkpoint_dir>/latest`` names, None without one; refuses a pointer to a missing folder."""
    pointer = Path(checkpoint_dir) / LATEST
    tag = read_latest(checkpoint_dir)
    if tag is None:
        return None
    if not (Path(checkpoint_dir) / tag).is_dir():
        raise ConfigError(
            f"{pointer}: names tag {tag!r}, which does not exist; restore that folder, pass an existing tag "
            f"folder, or delete {pointer} to start the run over"
        )
    return tag


def resolve_tag_dir(path: str | Path, step: int | None = None) -> Path:
    """The tag folder ``path`` names: a tag folder, a checkpoint folder (its `latest`) or a run folder
    (``<run_dir>/checkpoints/latest``); with ``step``, that step's tag of the run (a milestone, say)."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path}: checkpoint not found; pass a tag folder (.../step-0000123) or a checkpoint folder")
    if step is not None:
        return _tag_at_step(path, step)
    for candidate in (path, path / "checkpoints"):
        if config_file(candidate).is_file():
            return candidate
        tag = latest_tag(candidate)
        if tag is not None:
            return candidate / tag
    raise ConfigError(f"{path}: neither a checkpoint tag folder (config.yaml) nor a folder with a `latest` file")


def checkpoint_folder(path: str | Path) -> Path:
    """The folder holding a run's tags: ``path`` itself, a run folder's checkpoints/, or a tag's parent."""
    path = Path(path)
    for candidate in (path / "checkpoints", path):
        if candidate.is_dir() and (read_latest(candidate) is not None or tag_names(candidate)):
            return candidate
    if config_file(path).is_file():
        return path.parent
    raise ConfigError(f"{path}: no checkpoints in it; pass a run folder, its checkpoints/ folder or a tag folder")


def _tag_at_step(path: Path, step: int) -> Path:
    folder = checkpoint_folder(path)
    tag_dir = folder / tag_for(step)
    if config_file(tag_dir).is_file():
        return tag_dir
    have = [tag_step(t) for t in tag_names(folder)]
    marks = set(milestone_tags(folder))
    listed = ", ".join(f"{s}{' (milestone)' if tag_for(s) in marks else ''}" for s in have) or "none"
    raise ConfigError(f"{folder}: no checkpoint at step {step}; steps kept: {listed}")


# --- integrity: what a complete checkpoint holds ----------------------------------------------------------
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) of the default process group, (0, 1) without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def hash_share(paths: list[Path]) -> dict[str, dict[str, Any]]:
    """This rank's share of ``paths`` (dealt round-robin over the ranks), each file's integrity entry."""
    rank, world = rank_and_world()
    return {p.name: file_record(p) for p in paths[rank::world]}


def _hash_shared(paths: list[Path]) -> dict[str, str]:
    """sha256 of every path, the work dealt round-robin over the ranks (a collective when there are several)."""
    import torch.distributed as dist

    rank, world = rank_and_world()
    mine = {name: entry["sha256"] for name, entry in hash_share(paths).items()}
    if world == 1:
        return mine
    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, mine)
    return {k: v for part in parts for k, v in part.items()}


def write_integrity(tag_dir: Path, meta: dict[str, Any]) -> None:
    """Every rank: hash the tag folder's files (shared out); rank 0 writes the record atomically, last."""
    files = tag_files(tag_dir)
    hashes = _hash_shared(files)
    if rank_and_world()[0] == 0:
        write_record(tag_dir, meta, {p.name: {"size": p.stat().st_size, "sha256": hashes[p.name]} for p in files})


def file_record(path: Path) -> dict[str, Any]:
    """One file's entry in the integrity record."""
    return {"size": path.stat().st_size, "sha256": _sha256(path)}


def tag_files(tag_dir: Path) -> list[Path]:
    """The files the integrity record covers: every visible file of the tag folder but the record."""
    return sorted(
        p for p in Path(tag_dir).iterdir() if p.is_file() and not p.name.startswith(".") and p.name != INTEGRITY
    )


def write_record(tag_dir: Path, meta: dict[str, Any], files: dict[str, dict[str, Any]]) -> None:
    """The integrity record, atomically: the last file of a tag."""
    write_atomic(Path(tag_dir) / INTEGRITY, json.dumps({**meta, "files": files}, indent=1))


def read_integrity(tag_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((Path(tag_dir) / INTEGRITY).read_text())
    except (OSError, ValueError):
        return None


def verify(tag_dir: Path, hashes: bool = True) -> str | None:
    """None if the tag folder matches its integrity record, else what is wrong (one phrase). Every rank
    calls it together: the sha256 work is shared out."""
    tag_dir = Path(tag_dir)
    record = read_integrity(tag_dir)
    if record is None:
        return f"{INTEGRITY} is missing or unreadable (the save did not complete)"
    present = []
    for name, want in sorted(record["files"].items()):
        path = tag_dir / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != want["size"]:
            return f"{name} has {size} bytes, the record says {want['size']} (truncated or overwritten)"
        present.append(path)
    if hashes:
        got = _hash_shared(present)
        for path in present:
            if got[path.name] != record["files"][path.name]["sha256"]:
                return f"{path.name} does not match its sha256 (corrupted)"
    return None


def tag_step(name: str) -> int | None:
    if len(name) == len(tag_for(0)) and name.startswith("step-") and name[5:].isdigit():
        return int(name[5:])
    return None


def tag_names(checkpoint_dir: str | Path) -> list[str]:
    """The tag folders of a checkpoint folder, oldest first, intact or not: each reader applies its own
    policy to them (resume falls back past damaged ones, export and eval refuse, pruning keeps milestones)."""
    folder = Path(checkpoint_dir)
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if tag_step(p.name) is not None and p.is_dir())


def milestone_tags(checkpoint_dir: Path) -> list[str]:
    """The milestone tags of a checkpoint folder, oldest first."""
    return [t for t in tag_names(checkpoint_dir) if (read_integrity(Path(checkpoint_dir) / t) or {}).get("milestone")]


# --- reading weights (inference) ------------------------------------------------------------------------
@dataclass
class CheckpointInfo:
    tag_dir: Path
    step: int
    run_id: str | None  # the MLflow run the checkpoint belongs to, None if it had none
    client_state: dict[str, Any]  # its JSON-like part


def read_weights(tag_dir: Path, tp_rank: int | None = None) -> tuple[dict[str, Any], CheckpointInfo]:
    """(model state dict, CheckpointInfo) on the CPU: of a TP=1 tag folder (a TP checkpoint is refused), or,
    with ``tp_rank``, that TP rank's part of any tag folder."""
    import torch

    name = model_states_file(tp_rank or 0)
    if tp_rank is None:
        shards = sorted(p.name for p in Path(tag_dir).glob("mp_rank_*_model_states.pt"))
        if len(shards) > 1:
            raise ConfigError(
                f"{tag_dir}: {len(shards)} model shards (a tensor-parallel checkpoint); inference loads TP=1 "
                "checkpoints only; retrain or convert with parallel.tp=1"
            )
    if not (Path(tag_dir) / name).is_file():
        raise ConfigError(f"{tag_dir}: {name} is missing (an incomplete checkpoint); use another checkpoint of the run")
    want = ((read_integrity(tag_dir) or {}).get("files") or {}).get(name)
    size = (Path(tag_dir) / name).stat().st_size
    if want is not None and want["size"] != size:
        raise ConfigError(
            f"{tag_dir}: {name} has {size} bytes, its integrity record says {want['size']} (truncated); "
            f"use another checkpoint of the run"
        )
    state = torch.load(Path(tag_dir) / name, map_location="cpu", weights_only=False)
    weights = state.pop("module")
    if next(iter(weights)).startswith("module."):  # saved from a wrapper
        weights = {k.removeprefix("module."): v for k, v in weights.items()}
    client_state = _plain_copy(state)
    info = CheckpointInfo(Path(tag_dir), int(client_state["prism"]["step"]), client_state.get("run_id"), client_state)
    return weights, info


def _plain_copy(value: Any) -> Any:
    """The JSON-like part of the client state (drops tensors, numpy RNG states and the like)."""
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    if isinstance(value, dict):
        kept = {str(k): _plain_copy(v) for k, v in value.items()}
        return {k: v for k, v in kept.items() if v is not _DROP}
    if isinstance(value, list | tuple):
        kept = [_plain_copy(v) for v in value]
        return [v for v in kept if v is not _DROP]
    return _DROP


_DROP = object()

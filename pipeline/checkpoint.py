"""Checkpoints: DeepSpeed's files plus our client state, an atomic ``latest`` pointer, keep-last-K pruning.

Layout: ``<checkpoint_dir>/step-0000123/`` holds DeepSpeed's ``mp_rank_XX_model_states.pt`` (its "module"
entry is the model state dict; our client state rides along inside it) and ZeRO ``*_optim_states.pt``,
plus ``config.yaml``. ``<checkpoint_dir>/latest`` names the newest complete tag; it is replaced (temp +
rename) only after every rank has finished writing, so a checkpoint killed half-way is never picked up.

DeepSpeed writes client state only from DP rank 0, so the per-rank parts (RNG states, loader positions) are
gathered to every rank first and stored as one list indexed by global rank.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from pipeline.atomic import write_atomic
from pipeline.config import Config, ConfigError, changed_keys

LATEST = "latest"
CONFIG_NAME = "config.yaml"


def tag_for(step: int) -> str:
    return f"step-{step:07d}"


def latest_tag(checkpoint_dir: Path) -> str | None:
    pointer = Path(checkpoint_dir) / LATEST
    if not pointer.is_file():
        return None
    tag = pointer.read_text().strip()
    if not (Path(checkpoint_dir) / tag).is_dir():
        raise ConfigError(
            f"{pointer}: points at {tag!r}, which does not exist; restore that folder or delete {pointer} to start over"
        )
    return tag


def check_resume(cfg: Config) -> str | None:
    """The tag to resume from (None for a fresh run); refuses when a model- or data-affecting key changed."""
    tag = latest_tag(cfg.checkpoint_dir)
    if tag is None:
        return None
    saved_path = cfg.checkpoint_dir / tag / CONFIG_NAME
    saved = yaml.safe_load(saved_path.read_text())
    changed = changed_keys(saved, cfg.to_dict())
    if changed:
        key = changed[0]
        old, new = _lookup(saved, key), _lookup(cfg.to_dict(), key)
        raise ConfigError(
            f"{saved_path}: cannot resume, {key} changed ({old!r} -> {new!r}) and it affects the model or data; "
            f"restore it or use a new checkpoint.dir / run.output_dir"
        )
    return tag


def _lookup(d: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(d, dict):
            return None
        d = d.get(part)
    return d


# --- RNG states ---------------------------------------------------------------------------------------
def rng_state() -> dict[str, Any]:
    import torch

    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    try:  # megatron's model-parallel RNG tracker (dropout inside TP regions)
        from megatron.core import tensor_parallel

        state["megatron"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    except Exception:
        pass
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "megatron" in state:
        from megatron.core import tensor_parallel

        tensor_parallel.get_cuda_rng_tracker().set_states(state["megatron"])


# --- save / load (every rank calls these) -------------------------------------------------------------
def save(engine: Any, cfg: Config, step: int, client_state: dict[str, Any], per_rank: dict[str, Any]) -> str:
    """Write tag ``step-NNNNNNN``; ``per_rank`` (this rank's loader position, ...) is gathered over all ranks."""
    import torch.distributed as dist

    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, {**per_rank, "rng": rng_state()})
    tag = tag_for(step)
    ckpt_dir = cfg.checkpoint_dir
    state = {**client_state, "prism": {"step": step, "ranks": ranks, "config_hash": cfg.hash()}}
    engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state=state, save_latest=False)
    if dist.get_rank() == 0:
        write_atomic(ckpt_dir / tag / CONFIG_NAME, cfg.dump())
    dist.barrier()  # every rank's files are on disk before the pointer moves
    if dist.get_rank() == 0:
        write_atomic(ckpt_dir / LATEST, tag)
        prune(ckpt_dir, cfg.checkpoint.keep_last, keep=tag)
    dist.barrier()
    return tag


def prune(checkpoint_dir: Path, keep_last: int, keep: str) -> None:
    tags = sorted(p.name for p in Path(checkpoint_dir).glob("step-*") if p.is_dir())
    for old in tags[: max(0, len(tags) - max(1, keep_last))]:
        if old != keep:
            shutil.rmtree(Path(checkpoint_dir) / old, ignore_errors=True)


def load(engine: Any, cfg: Config, tag: str) -> dict[str, Any]:
    """Load tag into the engine; returns the client state with ``prism.rank`` = this rank's part."""
    import torch.distributed as dist

    path, client = engine.load_checkpoint(str(cfg.checkpoint_dir), tag=tag, load_lr_scheduler_states=False)
    if path is None:
        raise ConfigError(
            f"{cfg.checkpoint_dir / tag}: DeepSpeed found no checkpoint files; delete the folder to restart"
        )
    ranks = client["prism"]["ranks"]
    if len(ranks) != dist.get_world_size():
        raise ConfigError(
            f"{cfg.checkpoint_dir / tag}: saved by {len(ranks)} processes, this run has {dist.get_world_size()}; "
            f"resume with the same number of processes (ZeRO shards are per DP rank)"
        )
    client["prism"]["rank"] = ranks[dist.get_rank()]
    set_rng_state(client["prism"]["rank"]["rng"])
    return client

"""Checkpoints: the train state, DeepSpeed's files, an atomic ``latest`` pointer, keep-last-K pruning.

Layout: ``<checkpoint_dir>/step-0000123/`` holds DeepSpeed's ``mp_rank_XX_model_states.pt`` (its "module"
entry is the model state dict; our client state rides along inside it) and ZeRO ``*_optim_states.pt``,
plus ``config.yaml``. ``<checkpoint_dir>/latest`` names the newest complete tag; it is replaced (temp +
rename) only after every rank has finished writing, so a checkpoint killed half-way is never picked up.

Client state: ``{"tokens_seen", "run_id", "prism": {"step", "ranks", "config_hash"}}``. DeepSpeed writes it
only from DP rank 0, so the per-rank parts of the train state (loader position, RNG states) are gathered to
every rank first and stored as one list indexed by global rank.

This module alone knows that layout: the trainer saves and loads a TrainState, readers (inference) get
weights through resolve_tag_dir and read_weights.
"""

from __future__ import annotations

import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from pipeline.atomic import write_atomic
from pipeline.config import Config, ConfigError, changed_keys

LATEST = "latest"
CONFIG_NAME = "config.yaml"
MODEL_STATES = "mp_rank_00_model_states.pt"  # TP rank 0's weights; TP=N writes mp_rank_00 .. mp_rank_N-1


def tag_for(step: int) -> str:
    return f"step-{step:07d}"


def config_file(tag_dir: Path) -> Path:
    """The config the checkpoint was trained with."""
    return Path(tag_dir) / CONFIG_NAME


# --- where checkpoints are -------------------------------------------------------------------------------
def latest_tag(checkpoint_dir: Path) -> str | None:
    """The tag ``<checkpoint_dir>/latest`` names, None without one; refuses a pointer to a missing folder."""
    pointer = Path(checkpoint_dir) / LATEST
    if not pointer.is_file():
        return None
    tag = pointer.read_text().strip()
    if not (Path(checkpoint_dir) / tag).is_dir():
        raise ConfigError(
            f"{pointer}: names tag {tag!r}, which does not exist; restore that folder, pass an existing tag "
            f"folder, or delete {pointer} to start the run over"
        )
    return tag


def resolve_tag_dir(path: str | Path) -> Path:
    """The tag folder ``path`` names: a tag folder, a checkpoint folder (its `latest`) or a run folder
    (``<run_dir>/checkpoints/latest``)."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path}: checkpoint not found; pass a tag folder (.../step-0000123) or a checkpoint folder")
    for candidate in (path, path / "checkpoints"):
        if config_file(candidate).is_file():
            return candidate
        tag = latest_tag(candidate)
        if tag is not None:
            return candidate / tag
    raise ConfigError(f"{path}: neither a checkpoint tag folder (config.yaml) nor a folder with a `latest` file")


def check_resume(cfg: Config) -> str | None:
    """The tag to resume from (None for a fresh run); refuses when a model- or data-affecting key changed."""
    tag = latest_tag(cfg.checkpoint_dir)
    if tag is None:
        return None
    saved_path = config_file(cfg.checkpoint_dir / tag)
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


# --- the train state ------------------------------------------------------------------------------------
@dataclass
class TrainState:
    """What a resume needs besides the engine's weights and optimizer. ``loader`` is this rank's data loader
    (anything with state_dict/load_state_dict); its position and the RNG states are per rank."""

    step: int = 0
    tokens_seen: int = 0
    run_id: str | None = None  # the tracking run, so a resumed run logs into the same one
    loader: Any = None

    PER_RANK = ("loader", "rng")

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "run_id": self.run_id,
            "loader": self.loader.state_dict() if self.loader is not None else None,
            "rng": _rng_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.tokens_seen, self.run_id = state["step"], state["tokens_seen"], state.get("run_id")
        if self.loader is not None:
            self.loader.load_state_dict(state["loader"])
        _set_rng_state(state["rng"])


def _rng_state() -> dict[str, Any]:
    import torch

    from pipeline import compat

    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "megatron": compat.model_parallel_rng_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    import torch

    from pipeline import compat

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "megatron" in state:
        compat.set_model_parallel_rng_states(state["megatron"])


# --- save / load (every rank calls these) -------------------------------------------------------------
def save(engine: Any, cfg: Config, state: TrainState) -> str:
    """Write tag ``step-NNNNNNN`` for ``state.step``; the per-rank parts are gathered over all ranks."""
    import torch.distributed as dist

    own = state.state_dict()
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, {k: own[k] for k in TrainState.PER_RANK})
    tag = tag_for(state.step)
    ckpt_dir = cfg.checkpoint_dir
    client_state = {
        "tokens_seen": own["tokens_seen"],
        "run_id": own["run_id"],
        "prism": {"step": own["step"], "ranks": ranks, "config_hash": cfg.hash(), "spec": cfg.model.spec},
    }
    engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state=client_state, save_latest=False)
    if dist.get_rank() == 0:
        write_atomic(config_file(ckpt_dir / tag), cfg.dump())
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


def load(engine: Any, cfg: Config, tag: str, state: TrainState) -> None:
    """Load tag into the engine and ``state`` (this rank's loader position and RNG states included)."""
    import torch.distributed as dist

    path, client = engine.load_checkpoint(str(cfg.checkpoint_dir), tag=tag, load_lr_scheduler_states=False)
    if path is None:
        raise ConfigError(
            f"{cfg.checkpoint_dir / tag}: DeepSpeed found no checkpoint files; delete the folder to restart"
        )
    check_spec_matches(client, cfg, tag)
    ranks = client["prism"]["ranks"]
    if len(ranks) != dist.get_world_size():
        raise ConfigError(
            f"{cfg.checkpoint_dir / tag}: saved by {len(ranks)} processes, this run has {dist.get_world_size()}; "
            f"resume with the same number of processes (ZeRO shards are per DP rank)"
        )
    shared = {"step": client["prism"]["step"], "tokens_seen": client["tokens_seen"], "run_id": client.get("run_id")}
    state.load_state_dict({**shared, **ranks[dist.get_rank()]})


def check_spec_matches(client: dict[str, Any], cfg: Config, tag: str) -> None:
    """The layer spec is part of the weights' layout (TE fuses norms, adds _extra_state): refuse another one.
    Checkpoints from before model.spec existed were built with the local spec."""
    saved = client["prism"].get("spec", "local")
    if saved != cfg.model.spec:
        raise ConfigError(
            f"{cfg.checkpoint_dir / tag}: built with model.spec={saved}, this run asks for model.spec="
            f"{cfg.model.spec}; their weights do not load into each other, use model.spec={saved} to resume"
        )


# --- reading weights (inference) ------------------------------------------------------------------------
@dataclass
class CheckpointInfo:
    tag_dir: Path
    step: int | None
    run_id: str | None  # the MLflow run the checkpoint belongs to, None if it had none
    client_state: dict[str, Any]  # its JSON-like part


def read_weights(tag_dir: Path) -> tuple[dict[str, Any], CheckpointInfo]:
    """(model state dict, CheckpointInfo) from a TP=1 tag folder, on the CPU."""
    import torch

    shards = sorted(p.name for p in Path(tag_dir).glob("mp_rank_*_model_states.pt"))
    if len(shards) > 1:
        raise ConfigError(
            f"{tag_dir}: {len(shards)} model shards (a tensor-parallel checkpoint); inference loads TP=1 "
            "checkpoints only; retrain or convert with parallel.tp=1"
        )
    if shards != [MODEL_STATES]:
        raise ConfigError(f"{tag_dir}: {MODEL_STATES} is missing; the checkpoint is incomplete")
    state = torch.load(Path(tag_dir) / MODEL_STATES, map_location="cpu", weights_only=False)
    weights = state.pop("module")
    if next(iter(weights)).startswith("module."):  # saved from a wrapper
        weights = {k.removeprefix("module."): v for k, v in weights.items()}
    client_state = _plain_copy(state)
    step = (client_state.get("prism") or {}).get("step", client_state.get("global_steps"))
    info = CheckpointInfo(
        Path(tag_dir), int(step) if step is not None else None, client_state.get("run_id"), client_state
    )
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

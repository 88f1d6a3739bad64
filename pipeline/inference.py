"""Load a training checkpoint for inference: (config, model, checkpoint facts) on CPU or GPU.

Accepts a tag folder (`<checkpoint_dir>/step-0000123`), a checkpoint folder (follows its `latest`), or a
run folder (`<run_dir>/checkpoints/latest`). Reads the config the run was trained with (`config.yaml` in
the tag folder) and DeepSpeed's `mp_rank_00_model_states.pt`, whose "module" entry is the state dict and
whose other top-level entries are the trainer's client state (step, tracking run id, ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from pipeline import config as config_lib
from pipeline.config import Config, ConfigError
from pipeline.distributed import resolve_device

MODEL_STATES = "mp_rank_00_model_states.pt"
# Overrides may repoint paths (tokenizer, dataset, tracking) but never change what the weights mean.
FROZEN_KEYS = ("model", "schedule", "parallel.tp")


@dataclass
class CheckpointInfo:
    tag_dir: Path
    step: int | None
    run_id: str | None  # the MLflow run the checkpoint belongs to, None if it had none
    client_state: dict[str, Any]


def resolve_tag_dir(path: str | Path) -> Path:
    """The tag folder that ``path`` names, directly or through a `latest` file."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path}: checkpoint not found; pass a tag folder (.../step-0000123) or a checkpoint folder")
    for candidate in (path, path / "checkpoints"):
        latest = candidate / "latest"
        if (candidate / "config.yaml").is_file():
            return candidate
        if latest.is_file():
            tag = latest.read_text().strip()
            if not (candidate / tag).is_dir():
                raise ConfigError(f"{latest}: names tag {tag!r}, which is missing; pass an existing tag folder")
            return candidate / tag
    raise ConfigError(f"{path}: neither a checkpoint tag folder (config.yaml) nor a folder with a `latest` file")


def load_config(tag_dir: Path, overrides: list[str] | None = None) -> Config:
    source = tag_dir / "config.yaml"
    data = yaml.safe_load(source.read_text())
    cfg = config_lib.from_dict(config_lib.apply_overrides(data, overrides or []), str(source))
    frozen = config_lib.changed_keys(data, cfg.to_dict(), scope=FROZEN_KEYS)
    if frozen:
        raise ConfigError(f"override of {frozen[0]}: the checkpoint's weights fix it; override only paths")
    return cfg


def load_checkpoint(path: str | Path, overrides: list[str] | None = None, device: str = "auto"):
    """(cfg, model in eval mode, CheckpointInfo). TP=1 checkpoints only."""
    import torch

    from pipeline import compat
    from pipeline.model import build_model
    from pipeline.tracking.journal import journal_run_id

    tag_dir = resolve_tag_dir(path)
    # Place the model where this machine can run it; build_model reads train.device (and train.precision,
    # so a bf16 run is evaluated in bf16 — on GPU the path the paper's numbers come from).
    cfg = load_config(tag_dir, [*(overrides or []), f"train.device={resolve_device(device)}"])
    shards = sorted(p.name for p in tag_dir.glob("mp_rank_*_model_states.pt"))
    if cfg.parallel.tp != 1 or len(shards) > 1:
        raise ConfigError(
            f"{tag_dir}: trained with parallel.tp={cfg.parallel.tp} ({len(shards)} model shards); inference "
            "loads TP=1 checkpoints only; retrain or convert with parallel.tp=1"
        )
    if shards != [MODEL_STATES]:
        raise ConfigError(f"{tag_dir}: {MODEL_STATES} is missing; the checkpoint is incomplete")

    compat.init_model_parallel(tp=1, seed=cfg.run.seed)
    model = build_model(cfg)
    state = torch.load(tag_dir / MODEL_STATES, map_location="cpu", weights_only=False)
    weights = state["module"]
    if next(iter(weights)).startswith("module.") and not next(iter(model.state_dict())).startswith("module."):
        weights = {k.removeprefix("module."): v for k, v in weights.items()}  # saved from a wrapper
    model.load_state_dict(weights, strict=True)
    model.eval()

    client_state = _plain_copy({k: v for k, v in state.items() if k != "module"})
    prism_state = client_state.get("prism") or {}
    step = prism_state.get("step", client_state.get("global_steps"))
    run_id = client_state.get("run_id") or journal_run_id(cfg.checkpoint_dir)
    info = CheckpointInfo(tag_dir, int(step) if step is not None else None, run_id, client_state)
    return cfg, model, info


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


def load_tokenizer(cfg: Config):
    """The run's tokenizer (cfg.data.tokenizer, a tokenizer.json path) and its EOS id."""
    from tokenizers import Tokenizer

    path = Path(cfg.data.tokenizer)
    if not path.is_file():
        raise ConfigError(
            f"data.tokenizer={cfg.data.tokenizer}: tokenizer file not found; pass data.tokenizer=PATH/tokenizer.json"
        )
    tok = Tokenizer.from_file(str(path))
    eos = tok.token_to_id(cfg.data.eos_token)
    if eos is None:
        raise ConfigError(f"data.eos_token={cfg.data.eos_token!r} is not in {path}; set data.eos_token")
    return tok, eos

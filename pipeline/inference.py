"""Load a training checkpoint for inference: (config, model, checkpoint facts) on CPU or GPU.

Accepts a tag folder (`<checkpoint_dir>/step-0000123`), a checkpoint folder (follows its `latest`), or a
run folder (`<run_dir>/checkpoints/latest`). Reads the config the run was trained with and the weights
through pipeline.checkpoint, which alone knows DeepSpeed's file layout.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from pipeline import checkpoint
from pipeline import config as config_lib
from pipeline.config import Config, ConfigError
from pipeline.distributed import resolve_device

# Overrides may repoint paths (tokenizer, dataset, tracking) but never change what the weights mean.
FROZEN_KEYS = ("model", "schedule", "parallel.tp")


def load_config(tag_dir: Path, overrides: list[str] | None = None) -> Config:
    source = checkpoint.config_file(tag_dir)
    data = yaml.safe_load(source.read_text())
    cfg = config_lib.from_dict(config_lib.apply_overrides(data, overrides or []), str(source))
    frozen = config_lib.changed_keys(data, cfg.to_dict(), scope=FROZEN_KEYS)
    if frozen:
        raise ConfigError(f"override of {frozen[0]}: the checkpoint's weights fix it; override only paths")
    return cfg


def load_checkpoint(path: str | Path, overrides: list[str] | None = None, device: str = "auto"):
    """(cfg, model in eval mode, checkpoint.CheckpointInfo). TP=1 checkpoints only."""
    from pipeline.distributed import init_model_parallel
    from pipeline.model import build_model
    from pipeline.tracking.journal import journal_run_id

    tag_dir = checkpoint.resolve_tag_dir(path)
    # Place the model where this machine can run it; build_model reads train.device (and train.precision,
    # so a bf16 run is evaluated in bf16 — on GPU the path the paper's numbers come from).
    cfg = load_config(tag_dir, [*(overrides or []), f"train.device={resolve_device(device)}"])
    if cfg.parallel.tp != 1:
        raise ConfigError(
            f"{tag_dir}: trained with parallel.tp={cfg.parallel.tp}; inference loads TP=1 checkpoints only; "
            "retrain or convert with parallel.tp=1"
        )
    weights, info = checkpoint.read_weights(tag_dir)

    init_model_parallel(tp=1, seed=cfg.run.seed, device=cfg.train.device)
    model = build_model(cfg)
    model.load_state_dict(weights, strict=True)
    model.eval()
    # A run that started while MLflow was down gets its id in the journal only after the checkpoint.
    info.run_id = info.run_id or journal_run_id(cfg.checkpoint_dir)
    return cfg, model, info


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

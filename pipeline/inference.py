"""Load a training checkpoint for inference: (config, model, checkpoint facts) on CPU or GPU.

Accepts a tag folder (`<checkpoint_dir>/step-0000123`), a checkpoint folder (follows its `latest`), or a
run folder (`<run_dir>/checkpoints/latest`). Reads the config the run was trained with and the weights
through pipeline.checkpoint, which alone knows DeepSpeed's file layout.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from pipeline import checkpoint, model_size
from pipeline import config as config_lib
from pipeline.config import Config, ConfigError
from pipeline.config.resume_keys import WEIGHT_KEYS
from pipeline.dataset import eos_id
from pipeline.distributed import resolve_device


def load_config(tag_dir: Path, overrides: list[str] | None = None) -> Config:
    source = checkpoint.config_file(tag_dir)
    data = yaml.safe_load(source.read_text())
    cfg = config_lib.from_dict(config_lib.apply_overrides(data, overrides or []), str(source))
    frozen = config_lib.changed_keys(data, cfg.to_dict(), scope=WEIGHT_KEYS)
    if frozen:
        raise ConfigError(f"override of {frozen[0]}: the checkpoint's weights fix it; override only paths")
    return cfg


def load_checkpoint(path: str | Path, overrides: list[str] | None = None, device: str = "auto"):
    """(cfg, model in eval mode, checkpoint.CheckpointInfo). A tensor-parallel checkpoint's parts are joined
    (read_whole_weights) into one TP=1 model; ``cfg`` stays the run's (its parallel.tp as trained)."""
    from pipeline.distributed import init_model_parallel
    from pipeline.model import build_model, tp_layout
    from pipeline.tracking.journal import journal_run_id

    tag_dir = checkpoint.resolve_tag_dir(path)
    # Place the model where this machine can run it; build_model reads train.device (and train.precision,
    # so a bf16 run is evaluated in bf16 — on GPU the path the paper's numbers come from).
    cfg = load_config(tag_dir, [*(overrides or []), f"train.device={resolve_device(device)}"])
    weights, info = read_whole_weights(tag_dir, cfg)
    one_rank = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, tp=1))
    vocab = model_size.padded_vocab(one_rank)  # the TP size's vocab padding beyond it: rows never scored
    weights = {k: v[:vocab] if k in tp_layout.VOCAB_PARALLEL else v for k, v in weights.items()}

    init_model_parallel(tp=1, seed=cfg.run.seed, device=cfg.train.device)
    model = build_model(one_rank)
    model.load_state_dict(weights, strict=True)
    model.eval()
    # A run that started while MLflow was down gets its id in the journal only after the checkpoint.
    info.run_id = info.run_id or journal_run_id(cfg.checkpoint_dir)
    return cfg, model, info


def read_whole_weights(tag_dir: Path, cfg: Config):
    """(TP=1 megatron state dict, CheckpointInfo): every TP rank's part read by checkpoint.read_weights, joined
    by pipeline.model.tp_layout.gather (the vocab padding of the TP size kept)."""
    from pipeline.model import tp_layout

    if cfg.parallel.tp == 1:
        return checkpoint.read_weights(tag_dir)
    parts = [checkpoint.read_weights(tag_dir, tp_rank=rank) for rank in range(cfg.parallel.tp)]
    return tp_layout.gather([weights for weights, _ in parts], cfg), parts[0][1]


def tokenizer_file(cfg: Config) -> Path:
    """data.tokenizer in every spelling `prism prepare` accepts: a tokenizer.json path, or a Hub name such as
    gpt2 (the HF cache first, then the Hub). When that fails and the run's dataset is there, the tokenizer its
    manifest recorded. One ConfigError line when none resolves."""
    from data_prep.build import resolve_tokenizer
    from pipeline.dataset import MANIFEST, read_manifest

    spellings = [cfg.data.tokenizer]
    if (Path(cfg.data.dataset_dir) / MANIFEST).is_file():
        recorded = read_manifest(cfg.data.dataset_dir)["tokenizer"]["name_or_path"]
        spellings += [recorded] if recorded != cfg.data.tokenizer else []
    errors = []
    for name in spellings:
        try:
            return Path(resolve_tokenizer(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=name))))
        except ConfigError as e:
            errors.append(str(e))
    raise ConfigError(f"{'; '.join(errors)} (set data.tokenizer=PATH/tokenizer.json or a Hub name such as gpt2)")


def load_tokenizer(cfg: Config):
    """The run's tokenizer (see tokenizer_file for the spellings) and its EOS id."""
    from tokenizers import Tokenizer

    path = tokenizer_file(cfg)
    tok = Tokenizer.from_file(str(path))
    return tok, eos_id(tok, cfg.data.eos_token, path)

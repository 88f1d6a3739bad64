"""Cooldown branches: an annealed point from any kept checkpoint of a main run.

A branch is a run config of its own (the cooldown section: pipeline.config.CooldownConfig): its folder is
``<run.output_dir>/<arm>-<scale>-s<seed>-cooldown-<from_step>``, its MLflow run is new and carries the lineage
tags below, and it resumes from its own `latest` like any run. Its first start loads the main run's tag at
from_step the way a resume would (weights, optimizer state, loader position and RNG: the data order goes on
exactly), reading the main run's folder and never writing to it; its LR is pipeline.lr_schedule's.

This module owns what a branch may start from; every refusal happens before either folder is written:
no intact checkpoint at from_step, a decay past the data the epoch budget leaves, a main run trained with
another model, data or recipe (restore.check_resume_policy, the resume's own policy), a branch folder that
already holds another branch. `prism cooldown` (pipeline.cli.cooldown) writes and launches a branch's config;
the branch's MLflow tags naming its main run are pipeline.tracking.mlflow_run.branch_tags'.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from pipeline import budget, checkpoint
from pipeline.checkpoint import restore
from pipeline.config import Config, ConfigError, CooldownConfig, apply_overrides, from_dict
from pipeline.config.resume_keys import flatten

CONFIG_NAME = "cooldown.yaml"  # the branch's config, written by `prism cooldown` into the branch's folder


def main_tag_dir(cfg: Config) -> Path:
    """The main run's tag at cooldown.from_step."""
    return tag_at(cfg.main_run_dir, cfg.cooldown.from_step)


def tag_at(run_dir: str | Path, step: int) -> Path:
    """A run's tag at ``step``; refuses a step with no checkpoint, naming the steps kept."""
    try:
        return checkpoint.resolve_tag_dir(run_dir, step=step)
    except ConfigError as e:
        if f"no checkpoint at step {step}" not in str(e):
            raise ConfigError(f"cooldown.from_run_dir: {e}") from None
        raise ConfigError(
            f"cooldown.from_step: {e}; branch from a step kept there, or keep one in future main runs with "
            f"checkpoint.keep_every_steps (a milestone every that many steps is never pruned)"
        ) from None


def as_main(cfg: Config) -> Config:
    """``cfg`` without its cooldown section: what its main run's checkpoints must have been trained with."""
    return dataclasses.replace(cfg, cooldown=CooldownConfig())


def check_start(cfg: Config, tag_dir: Path, dp: int | None) -> None:
    """The branch may start from ``tag_dir`` at data-parallel size ``dp`` (None: the size it was saved at)."""
    record = checkpoint.read_integrity(tag_dir) or {}
    if record.get("weights_only"):
        raise ConfigError(
            f"{tag_dir}: a weights-only milestone (checkpoint.milestone_weights_only dropped its optimizer state), "
            "so a branch cannot continue its training; branch from a full checkpoint"
        )
    if (problem := checkpoint.verify(tag_dir)) is not None:
        raise ConfigError(f"{tag_dir}: {problem}; branch from another step")
    restore.check_resume_policy(as_main(cfg), tag_dir, record.get("dp_size"), dp)
    check_data_left(cfg, dp or record.get("dp_size") or 1)


def check_data_left(cfg: Config, dp: int) -> None:
    """The branch's decay ends within one epoch of the train split unless data.allow_repeat."""
    manifest = budget.read_manifest_if_prepared(cfg)
    if manifest is None or cfg.data.allow_repeat:
        return  # the trainer refuses a missing dataset itself, before step 1
    per_epoch, t, c = budget.tokens_per_epoch(manifest, dp), cfg.train, cfg.cooldown
    left = per_epoch - c.from_step * t.batch_tokens
    if budget.trained_tokens(cfg) > per_epoch:
        raise ConfigError(
            f"cooldown.decay_tokens: {c.decay_tokens:,} tokens after step {c.from_step} run past the "
            f"{per_epoch:,}-token epoch of {cfg.data.dataset_dir} (DP {dp}): {max(0, left):,} tokens are left; "
            f"decay over at most {max(0, left) // t.batch_tokens * t.batch_tokens:,} or set data.allow_repeat=true"
        )


def check_folder(cfg: Config) -> bool:
    """Whether the branch's folder holds a start of this very branch (it resumes); refuses another branch's."""
    tag = checkpoint.read_latest(cfg.checkpoint_dir)
    if tag is None:
        return False
    saved_path = checkpoint.config_file(cfg.checkpoint_dir / tag)
    try:
        saved = flatten(yaml.safe_load(saved_path.read_text()).get("cooldown") or {}, "cooldown.")
    except (OSError, yaml.YAMLError, AttributeError):
        return True  # unreadable: the resume's own checks say so
    now = flatten(dataclasses.asdict(cfg.cooldown), "cooldown.")
    if saved != now:
        key = next(k for k in now if saved.get(k) != now[k])
        raise ConfigError(
            f"{cfg.run_dir}: already holds another branch ({key}={saved.get(key)!r}, not {now[key]!r}); "
            f"give this branch another run.output_dir (prism cooldown --out DIR) or delete {cfg.run_dir}"
        )
    return True


def start_point(cfg: Config, dp: int | None) -> restore.Resume | None:
    """A branch's first start: where it loads from (the main run's tag); None when its own folder already
    holds a start of it (the ordinary resume then takes over). Refuses before anything is written."""
    if check_folder(cfg):
        return None
    tag_dir = main_tag_dir(cfg)
    check_start(cfg, tag_dir, dp)
    record = checkpoint.read_integrity(tag_dir) or {}
    return restore.Resume(
        tag=tag_dir.name,
        step=cfg.cooldown.from_step,
        saved_dp_size=record.get("dp_size"),
        saved_tp=record.get("tp"),
        source_dir=tag_dir.parent,
    )


# --- `prism cooldown`: the branch's config from the main run's ------------------------------------------------
def branch_config(
    run_dir: str,
    from_step: int,
    decay_tokens: int | None,
    decay_fraction: float | None,
    decay_shape: str | None = None,
    out: str | None = None,
    overrides: list[str] | None = None,
) -> Config:
    """The branch of the main run in ``run_dir`` at ``from_step``: the main run's config as its checkpoint there
    saved it, plus the cooldown section (``decay_fraction``: the share of the branch's tokens at its end that
    decay, like train.decay_fraction: 0.1 at step 900 decays over 100 steps), ``out``
    (run.output_dir; default the main run's, so both log to one MLflow store) and ``overrides``."""
    if from_step < 1:
        raise ConfigError(f"--from-step {from_step} must be >= 1")
    saved = checkpoint.config_file(tag_at(run_dir, from_step))
    try:
        probe = from_dict(yaml.safe_load(saved.read_text()), source=str(saved))
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"{saved}: unreadable ({e}); branch from another step") from None
    if probe.is_branch:
        raise ConfigError(f"{run_dir}: is itself a cooldown branch; branch from its main run {probe.main_run_dir}")
    if (decay_tokens is None) == (decay_fraction is None):
        raise ConfigError("give one of --decay-tokens T or --decay-fraction F")
    if decay_fraction is not None:
        if not 0 < decay_fraction < 1:
            raise ConfigError(f"--decay-fraction {decay_fraction} must be in (0, 1), e.g. 0.1")
        decay_tokens = decay_tokens_of(from_step, decay_fraction, probe.train.batch_tokens)
    branch = [f"cooldown.from_run_dir={run_dir}", f"cooldown.from_step={from_step}"]
    branch.append(f"cooldown.decay_tokens={decay_tokens}")
    if decay_shape:
        branch.append(f"cooldown.decay_shape={decay_shape}")
    if out:
        from pipeline.tracking.store import run_uri

        branch.append(f"run.output_dir={out}")
        if not probe.tracking.uri:  # the main run's store, not a new one in --out: compare reads them together
            branch.append(f"tracking.uri={run_uri(probe)}")
    data = apply_overrides(probe.to_dict(), [*branch, *(overrides or [])])
    return from_dict(data, source=f"cooldown of {run_dir} at step {from_step}")


def decay_tokens_of(from_step: int, decay_fraction: float, batch_tokens: int) -> int:
    """The tokens of a branch at ``from_step`` whose decay is ``decay_fraction`` of its whole length (its main
    steps plus the decay), as train.decay_fraction: 0.1 at step 900 decays over 100 steps; whole steps."""
    return max(1, round(decay_fraction * from_step / (1 - decay_fraction))) * batch_tokens


def write_config(cfg: Config) -> Path:
    """The branch's config in its own folder, where `prism train`, torchrun and sbatch read it."""
    from pipeline.atomic import write_atomic

    path = cfg.run_dir / CONFIG_NAME
    write_atomic(path, yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    return path

"""Plan: what to run, as `prism train` runs built only through `config.load`, and which already finished.

The demo, `prism study`, `prism sweep` and `prism search` build their runs here, so a run is named, placed,
read (presets, schedules in any spelling, overrides) and recognised as finished one way in all four.
A run is a preset plus the dotted overrides that make it (what `prism train` is given), and the config they
load to (its run name, run folder and hash). Finished means an MLflow run of that name whose result hash is
this config's (config.result_hash: what it trains and measures, so any spelling of a schedule finds it and
execution-only keys do not matter).
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline import config, schedule
from pipeline.config import Config, ConfigError

ALL_VALID = "all-valid"  # a schedule list that means every schedule the config accepts


@dataclass(frozen=True)
class GridRun:
    config_path: str  # the preset `prism train` is given
    overrides: tuple[str, ...]  # the dotted overrides that make this run from it (seed, schedule, folder)
    cfg: Config  # what they load to
    schedule: str | None = None  # the compact schedule the grid set; None: the preset's own

    @property
    def name(self) -> str:
        return self.cfg.run_name

    @property
    def run_dir(self) -> Path:
        return self.cfg.run_dir

    @property
    def label(self) -> str:
        """The run name, and the schedule where the grid set one (run names do not carry it)."""
        return self.name + (f" {self.schedule}" if self.schedule else "")

    def train_command(self) -> list[str]:
        return train_command(self.config_path, self.overrides)


def train_command(config_path: str, overrides: Sequence[str]) -> list[str]:
    """`prism train CONFIG OVERRIDES` in this interpreter (the demo, the study and local search trials)."""
    return [sys.executable, "-m", "pipeline.cli", "train", str(config_path), *overrides]


def expand_grid(
    configs: Sequence[str | Path],
    seeds: Sequence[int] | None = None,
    schedules: Sequence[str | None] = (None,),
    overrides: Sequence[str] = (),
) -> list[GridRun]:
    """Every (seed, config, schedule), seed-major (a grid stopped early holds whole seeds); ``seeds`` None keeps
    each config's own seed, a schedule None its own schedule. A schedule set here also gets its own folder,
    ``<run.output_dir>/sched-<schedule>`` (its data staying where the preset's is): the run name is the same
    for every schedule of an arm."""
    loaded = {path: config.load(path, overrides) for path in configs} if any(schedules) else {}
    runs = []
    for seed in [None] if seeds is None else seeds:
        for path in configs:
            for sched in schedules:
                extra = [] if seed is None else [f"run.seed={int(seed)}"]
                if sched is not None:
                    folder = Path(loaded[path].run.output_dir) / f"sched-{sched.replace(',', '_')}"
                    extra += [f"schedule.heads={sched}", *config.relocate(loaded[path], folder)]
                ov = (*overrides, *extra)
                runs.append(GridRun(str(path), ov, config.load(path, ov), sched))
    return runs


def finished_run_ids(cfgs: Sequence[Config]) -> list[str | None]:
    """Per config, the id of an MLflow run of it that already FINISHED (same run name and result_hash: what it
    trains and measures, not how it ran), else None; a store that does not exist yet holds none (and is not
    created by asking)."""
    from pipeline.config import result_hash
    from pipeline.tracking import store

    clients: dict[str, Any] = {}
    found: list[str | None] = []
    for cfg in cfgs:
        uri = store.run_uri(cfg)
        if not store.store_exists(uri):
            found.append(None)
            continue
        if uri not in clients:
            clients[uri] = store.client(uri)
        client = clients[uri]
        exp = client.get_experiment_by_name(cfg.experiment)
        runs = (
            []
            if exp is None
            else client.search_runs(
                [exp.experiment_id],
                filter_string=f"attributes.run_name = '{cfg.run_name}' and attributes.status = 'FINISHED' and "
                f"tags.result_hash = '{result_hash(cfg)}'",
                max_results=1,
            )
        )
        found.append(runs[0].info.run_id if runs else None)
    return found


def preset_path(arm: str, scale: str) -> Path:
    """The project's preset of ``arm`` at ``scale`` (config.preset_name), or one line listing the presets."""
    path = config.find_preset(config.preset_name(arm, scale), config.PROJECT_CONFIGS)
    if path is None:
        known = sorted(p.stem for p in config.PROJECT_CONFIGS.glob("*.yaml"))
        raise ConfigError(
            f"sweep: no preset for arm={arm!r} scale={scale!r} "
            f"({config.PROJECT_CONFIGS / config.preset_name(arm, scale)} missing); presets: {', '.join(known)}"
        )
    return path


def all_valid_schedules(base: Config) -> list[str]:
    """Every schedule ``base``'s model and TP accept (schedule.enumerate_valid), in compact form."""
    m, p = base.model, base.parallel
    return [
        schedule.compact(h)
        for h in schedule.enumerate_valid(
            m.d_model, m.num_layers, m.h_base, p.tp, replicate_indivisible=p.replicate_indivisible_layers
        )
    ]


def expand_schedules(
    schedules: Any, arm: str, scale: str, overrides: list[str], path: Path | None = None
) -> list[str | None]:
    """None -> the preset's schedule; "all-valid" -> every schedule the preset's config accepts; else a list.
    ``path``: the preset (default the project's of ``arm`` at ``scale``).

    Each schedule is resolved by the config (a preset name such as paper-124m, a list or the compact form),
    so the sweep accepts exactly what `prism train` accepts, and returns each one in compact form."""
    if schedules in (None, [], ()):
        return [None]
    path = path or preset_path(arm, scale)
    if schedules == ALL_VALID:
        base = config.load(path, overrides)
        found = all_valid_schedules(base)
        if not found:
            raise ConfigError(
                f"sweep: schedules=all-valid found no valid schedule for {scale} (d_model {base.model.d_model})"
            )
        return found
    if isinstance(schedules, str):
        raise ConfigError(f"sweep: schedules={schedules!r}; use a list of schedules, {ALL_VALID!r} or null")
    resolved = []
    for spelled in schedules:
        try:
            resolved.append(config.load(path, [*overrides, f"schedule.heads={spelled}"]).schedule.heads)
        except ConfigError as e:
            raise ConfigError(f"sweep: arm {arm!r}, scale {scale!r}, schedule {spelled!r}: {e}") from None
    repeated = sorted({h for h in resolved if resolved.count(h) > 1})
    if repeated:  # two spellings of one schedule would train the same run twice, in one folder
        raise ConfigError(
            f"sweep: schedules name {', '.join(repeated)} more than once (two spellings of one schedule); list each once"
        )
    return resolved


def build_grid(
    arms: list[str],
    scales: list[str],
    seeds: list[int],
    schedules: Any = None,
    overrides: dict[str, Any] | list[str] | None = None,
    configs: Sequence[str | Path] = (),
    cooldown: dict[str, Any] | None = None,
) -> list[GridRun]:
    """Every grid point (arm, scale, seed, schedule) of the project's presets, or of ``configs`` (preset paths,
    e.g. configs/wsds/tiny_prism.yaml, in place of arms x scales): its preset, the overrides that make it, its
    validated config. ``cooldown`` ({from_steps, decay_tokens | decay_fraction, decay_shape}, what `prism
    cooldown` is given) makes each point's cooldown branches at every step instead of the point itself."""
    for key, values in (("arms", arms), ("scales", scales), ("seeds", seeds)):
        if not values and not (configs and key != "seeds"):
            raise ConfigError(f"sweep: {key} is empty; give at least one value")
    base_overrides = config.override_list(overrides)
    if configs:
        presets = [(Path(p), config.load(p, base_overrides).run) for p in configs]
        points = [(path, run.arm, run.scale) for path, run in presets]
    else:
        points = [(preset_path(arm, scale), arm, scale) for arm, scale in itertools.product(arms, scales)]
    grid = []
    for path, arm, scale in points:
        per_arm = expand_schedules(schedules, arm, scale, base_overrides, path)
        # a job starts in the checkout, not in this directory: its folder and data are pinned here
        cfg = config.load(path, base_overrides)
        pinned = [*base_overrides, *config.relocate(cfg, cfg.run.output_dir)]
        grid += expand_grid([path], [int(s) for s in seeds], per_arm, pinned)
    return expand_branches(grid, cooldown) if cooldown else grid


def expand_branches(grid: list[GridRun], cooldown: dict[str, Any]) -> list[GridRun]:
    """Each run's cooldown branches, one per step of cooldown["from_steps"] (in the run's order, then the
    step's). A branch's main run is the grid point's own folder, named in cooldown.from_run_dir as `prism
    cooldown` names it: the branch's identity and resume policy read that key, so both write the same branch."""
    from pipeline.cooldown import decay_tokens_of

    branches = []
    for run in grid:
        for step in cooldown["from_steps"]:
            if step >= run.cfg.steps(1)["total"]:
                raise ConfigError(
                    f"sweep: cooldown.from_steps: {run.name} ends at step {run.cfg.steps(1)['total']:,}, so a branch "
                    f"at step {step:,} has nothing to branch from; give steps before it"
                )
            tokens = cooldown.get("decay_tokens") or decay_tokens_of(
                step, cooldown["decay_fraction"], run.cfg.train.batch_tokens
            )
            shape = [f"cooldown.decay_shape={cooldown['decay_shape']}"] if cooldown.get("decay_shape") else []
            branch = [f"cooldown.from_run_dir={run.cfg.main_run_dir}", f"cooldown.from_step={step}"]
            ov = (*run.overrides, *branch, f"cooldown.decay_tokens={tokens}", *shape)
            try:
                branches.append(GridRun(run.config_path, ov, config.load(run.config_path, ov), run.schedule))
            except ConfigError as e:
                raise ConfigError(f"sweep: {run.name}'s branch at step {step}: {e}") from None
    return branches

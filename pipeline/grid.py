"""The grid of runs: configs x seeds x schedules, one `prism train` run each, and which of them already finished.

The demo, `prism study` and `prism sweep` build their runs here, so a run is named, placed and recognised as
finished the same way in all three; anything else that launches `prism train` over a grid can do the same.
A run is a preset plus the dotted overrides that make it (what `prism train` is given), and the config they
load to (its run name, run folder and hash). Finished means an MLflow run of that name whose config hash is
this config's (the hash is over what the config builds, so any spelling of a schedule finds it).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline import config
from pipeline.config import Config


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
    ``<run.output_dir>/sched-<schedule>``: the run name is the same for every schedule of an arm."""
    output_dirs = {path: config.load(path, overrides).run.output_dir for path in configs} if any(schedules) else {}
    runs = []
    for seed in [None] if seeds is None else seeds:
        for path in configs:
            for sched in schedules:
                extra = [] if seed is None else [f"run.seed={int(seed)}"]
                if sched is not None:
                    out = output_dirs[path]
                    extra += [f"schedule.heads={sched}", f"run.output_dir={out}/sched-{sched.replace(',', '_')}"]
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

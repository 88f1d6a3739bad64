"""Sweeps of `prism train` over arms x scales x seeds x schedules, one submitit job per grid point; with a
``cooldown:`` section, the cooldown branches of each point at several steps instead (a WSD-S ladder).

    from pipeline import sweep
    s = sweep.submit(arms=["prism", "uniform"], scales=["124m"], seeds=[1, 2, 3], executor="slurm",
                     gpus_per_node=8, timeout_min=120)
    s.wait()                      # results of every job; s.manifest_path maps grid point -> job -> run

The grid goes out as one job per point, named after its run folder with Slurm's singleton dependency, so a
sweep rerun while its jobs run waits for them instead of training their folders twice. Each job is a submitit `Checkpointable`: on the
pre-timeout/preemption signal it asks its `prism train` processes to checkpoint, then returns a
DelayedSubmission, so submitit requeues it and the requeued job resumes from `latest`. Inside a job, one
task per node starts `torchrun` with the layout from `submitit.helpers.TorchDistributedEnvironment`.
The runs are planned by pipeline.runs.plan and launched by pipeline.runs.launch (TrainJob, make_executor),
as `prism search`'s on Slurm; the spec file reader (line and column of a bad field) is pipeline.runs.spec_file.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from pipeline import schedule
from pipeline.atomic import write_atomic
from pipeline.lr_schedule import DECAY_SHAPES
from pipeline.runs.launch import ROOT, TrainJob, first_result, make_executor, run_job_name
from pipeline.runs.plan import ALL_VALID, GridRun, build_grid
from pipeline.runs.spec_file import SpecFile, check_slurm_section, is_int, mapping_section
from pipeline.signals import DEFAULT_SIGNAL_LEAD_S, shutdown_grace


@dataclasses.dataclass
class Sweep:
    folder: Path
    manifest_path: Path
    points: list[GridRun]
    jobs: list[Any]

    def wait(self, timeout_s: float | None = None, poll_s: float = 1.0) -> list[Any]:
        """Results of all jobs in grid order; raises TimeoutError naming the unfinished jobs."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not all(j.done() for j in self.jobs):
            if deadline is not None and time.monotonic() > deadline:
                left = [
                    f"{p.label} (job {j.job_id}, {j.state})" for p, j in zip(self.points, self.jobs) if not j.done()
                ]
                raise TimeoutError(f"sweep {self.folder}: not finished after {timeout_s} s: {', '.join(left)}")
            time.sleep(poll_s)
        return [first_result(j) for j in self.jobs]

    def failures(self) -> list[str]:
        """Block until every job ends; one line per failed job (a failed job must not hide the others')."""
        failed = []
        for p, job in zip(self.points, self.jobs):
            try:
                first_result(job)
            except Exception as e:
                failed.append(f"{p.label}: job {job.job_id} failed: {str(e).splitlines()[-1] if str(e) else e}")
        return failed


def submit(
    arms: list[str],
    scales: list[str],
    seeds: list[int],
    schedules: Any = None,
    overrides: dict[str, Any] | list[str] | None = None,
    executor: str = "slurm",
    folder: str | Path | None = None,
    name: str = "sweep",
    nproc_per_node: int = 0,
    configs: list[str] | None = None,
    cooldown: dict[str, Any] | None = None,
    **executor_params: Any,
) -> Sweep:
    """Submit one job per grid point, named after its run; write the sweep manifest; return at once.

    executor_params go to make_executor (nodes, gpus_per_node, cpus_per_task, timeout_min, partition,
    signal_delay_s, additional_parameters, max_num_timeout)."""
    grid = build_grid(arms, scales, seeds, schedules, overrides, configs or (), cooldown)
    folder = Path(folder) if folder else ROOT / "runs" / "sweeps" / name
    folder.mkdir(parents=True, exist_ok=True)
    ex = make_executor(folder, executor, job_name=f"prism-{name}", **executor_params)
    grace = shutdown_grace(executor_params.get("signal_delay_s", DEFAULT_SIGNAL_LEAD_S))
    jobs = []
    for run in grid:  # a job each, named after its run: Slurm's singleton dependency is per job name
        ex.update_parameters(name=run_job_name(run.cfg.checkpoint_dir, run.name))
        jobs.append(ex.submit(TrainJob(run.config_path, run.overrides, nproc_per_node, grace)))
    manifest = {
        "name": name,
        "executor": executor,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "folder": str(folder),
        "jobs": [
            {
                "arm": run.cfg.run.arm,
                "scale": run.cfg.run.scale,
                "seed": run.cfg.run.seed,
                "schedule": schedule.compact(run.cfg.heads_per_layer),
                "branch_step": run.cfg.cooldown.from_step,
                "job_id": str(job.job_id),
                "run_name": run.name,
                "experiment": run.cfg.experiment,
                "tracking_uri": run.cfg.tracking.uri,
                "run_dir": str(run.run_dir),
                "config": run.config_path,
                "overrides": list(run.overrides),
            }
            for run, job in zip(grid, jobs)
        ],
    }
    manifest_path = folder / "sweep.json"
    write_atomic(manifest_path, json.dumps(manifest, indent=2) + "\n")
    return Sweep(folder, manifest_path, grid, jobs)


SPEC_KEYS = (
    "name",
    "arms",
    "scales",
    "configs",
    "seeds",
    "schedules",
    "overrides",
    "executor",
    "folder",
    "nproc_per_node",
    "slurm",
    "cooldown",
)
COOLDOWN_KEYS = ("from_steps", "decay_tokens", "decay_fraction", "decay_shape")  # `prism cooldown`'s options


def load_spec(path: str | Path) -> dict[str, Any]:
    """A sweep YAML: arms, scales, seeds, schedules (list | all-valid | null), overrides, executor, slurm:{...}.

    Every field is checked here, so a bad spec is one line naming the key and where it is (exit 2), never a
    traceback."""
    doc = SpecFile(path, "sweep spec", SPEC_KEYS)
    spec = doc.data

    configs = spec.get("configs")
    if configs is not None and (
        not isinstance(configs, list) or not configs or not all(isinstance(x, str) and x for x in configs)
    ):
        raise doc.bad("configs", "must be a non-empty list of preset paths, e.g. [configs/wsds/tiny_prism.yaml]")
    if configs is not None and ("arms" in spec or "scales" in spec):
        raise doc.error("configs", "give configs (preset paths) or arms and scales (the project's presets), not both")
    for i, given in enumerate(configs or []):  # a relative path is the project's, as launchers/ are
        path = Path(given) if Path(given).is_absolute() else ROOT / given
        if not path.is_file():
            raise doc.bad("configs", f"{given!r} is not a file; give presets like configs/wsds/tiny_prism.yaml")
        configs[i] = str(path)
    for key in () if configs is not None else ("arms", "scales"):
        v = spec.get(key)
        if not isinstance(v, list) or not v or not all(isinstance(x, str) and x for x in v):
            raise doc.error(key, f"{key} must be a non-empty list of names, got {v!r}")
    seeds = spec.get("seeds")
    if not isinstance(seeds, list) or not seeds:
        raise doc.error("seeds", f"seeds must be a non-empty list of integers, got {seeds!r}")
    for seed in seeds:
        if not is_int(seed) or seed < 0:
            raise doc.error("seeds", f"seeds: {seed!r} is not a non-negative integer; write seeds like [1, 2, 3]")
    if len(set(seeds)) != len(seeds):
        raise doc.error("seeds", f"seeds {seeds} repeat a seed; each grid point needs its own")
    schedules = spec.get("schedules")
    if not (schedules is None or schedules == ALL_VALID or isinstance(schedules, list)):
        raise doc.bad("schedules", f"use a list of schedules, {ALL_VALID!r} or null")
    if isinstance(schedules, list) and not all(isinstance(x, str) for x in schedules):
        raise doc.bad("schedules", 'write each schedule as a quoted string, e.g. "2x2,4x4"')
    overrides = spec.get("overrides")
    if not (overrides is None or isinstance(overrides, dict | list)):
        raise doc.bad("overrides", "use a mapping {dotted.key: value} or a list of 'dotted.key=value' strings")
    if spec.get("executor", "slurm") not in ("slurm", "local"):
        raise doc.bad("executor", "use slurm or local")
    for key in ("name", "folder"):
        if key in spec and not (isinstance(spec[key], str) and spec[key]):
            raise doc.bad(key, "must be a non-empty string")
    if "nproc_per_node" in spec and not (is_int(spec["nproc_per_node"]) and spec["nproc_per_node"] >= 0):
        raise doc.bad("nproc_per_node", "must be an integer >= 0 (0: one per GPU, 1 without GPUs)")
    check_slurm_section(doc)
    check_cooldown_section(doc)
    spec.setdefault("name", doc.path.stem)
    return spec


def check_cooldown_section(doc: SpecFile) -> None:
    """The ``cooldown:`` mapping: from_steps (the branch steps), one of decay_tokens or decay_fraction (as
    `prism cooldown --decay-tokens | --decay-fraction`) and an optional decay_shape."""
    c = mapping_section(doc, "cooldown", COOLDOWN_KEYS)
    if c is None:
        return
    steps = c.get("from_steps")
    if not isinstance(steps, list) or not steps or not all(is_int(s) and s >= 1 for s in steps):
        raise doc.bad("cooldown.from_steps", "must be a non-empty list of checkpoint steps >= 1, e.g. [36, 72, 144]")
    if len(set(steps)) != len(steps):
        raise doc.bad("cooldown.from_steps", "repeats a step; each branch needs its own")
    if ("decay_tokens" in c) == ("decay_fraction" in c):
        raise doc.error("cooldown", "cooldown: give one of decay_tokens (tokens each branch decays) or decay_fraction")
    if "decay_tokens" in c and not (is_int(c["decay_tokens"]) and c["decay_tokens"] >= 1):
        raise doc.bad("cooldown.decay_tokens", "must be a positive integer (whole steps of train.batch_tokens)")
    fraction = c.get("decay_fraction")
    if "decay_fraction" in c and not (isinstance(fraction, float) and 0 < fraction < 1):
        raise doc.bad("cooldown.decay_fraction", "must be in (0, 1), e.g. 0.1: the share of each branch that decays")
    if c.get("decay_shape") not in (None, *DECAY_SHAPES):
        raise doc.bad("cooldown.decay_shape", f"use one of {', '.join(DECAY_SHAPES)}")


def grid_of_spec(spec: dict[str, Any]) -> list[GridRun]:
    """The grid a sweep spec (from ``load_spec``) describes."""
    return build_grid(
        spec.get("arms", []),
        spec.get("scales", []),
        spec["seeds"],
        spec.get("schedules"),
        spec.get("overrides"),
        spec.get("configs") or (),
        spec.get("cooldown"),
    )


def grid_table(grid: list[GridRun]) -> str:
    """One line per grid point (what a dry run prints) and the job count."""
    rows = [f"{'#':>4}  {'arm':<8} {'scale':<6} {'seed':>6}  schedule   -> run name"]
    for i, run in enumerate(grid):
        r = run.cfg.run
        c = run.cfg.cooldown
        decay = f" (decays {c.decay_tokens // run.cfg.train.batch_tokens:,} steps)" if run.cfg.is_branch else ""
        rows.append(
            f"{i:>4}  {r.arm:<8} {r.scale:<6} {r.seed:>6}  {schedule.compact(run.cfg.heads_per_layer)}  -> {run.name}"
            + decay
        )
    rows.append(f"jobs: {len(grid)}")
    return "\n".join(rows)


def submit_spec(spec: dict[str, Any], executor: str | None = None) -> Sweep:
    """Submit a sweep spec (from ``load_spec``); ``executor`` overrides the spec's (default slurm)."""
    return submit(
        spec.get("arms", []),
        spec.get("scales", []),
        spec["seeds"],
        spec.get("schedules"),
        spec.get("overrides"),
        executor=executor or spec.get("executor", "slurm"),
        folder=spec.get("folder"),
        name=spec["name"],
        nproc_per_node=int(spec.get("nproc_per_node", 0)),
        configs=spec.get("configs"),
        cooldown=spec.get("cooldown"),
        **(spec.get("slurm") or {}),
    )

"""Sweeps of `prism train` over arms x scales x seeds x schedules, one submitit job per grid point.

    from launchers import sweep
    s = sweep.submit(arms=["prism", "uniform"], scales=["124m"], seeds=[1, 2, 3], executor="slurm",
                     gpus_per_node=8, timeout_min=120)
    s.wait()                      # results of every job; s.manifest_path maps grid point -> job -> run

The grid goes out as one job array (`executor.batch()`). Each job is a submitit `Checkpointable`: on the
pre-timeout/preemption signal it asks its `prism train` processes to checkpoint, then returns a
DelayedSubmission, so submitit requeues it and the requeued job resumes from `latest`. Inside a job, one
task per node starts `torchrun` with the layout from `submitit.helpers.TorchDistributedEnvironment`.
The runs are pipeline.grid's; the spec file reader (line and column of a bad field) is launchers.spec, which
`prism search` shares.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import submitit

from launchers import recovery
from launchers.spec import SpecFile, check_slurm_section, is_int
from pipeline import config, schedule
from pipeline.atomic import write_atomic
from pipeline.config import ConfigError
from pipeline.exit_codes import EXIT_STOPPED
from pipeline.grid import GridRun, expand_grid

ROOT = Path(__file__).resolve().parent.parent
ALL_VALID = "all-valid"


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


def expand_schedules(schedules: Any, arm: str, scale: str, overrides: list[str]) -> list[str | None]:
    """None -> the preset's schedule; "all-valid" -> every schedule the preset's config accepts; else a list.

    Each schedule is resolved by the config (a preset name such as paper-124m, a list or the compact form),
    so the sweep accepts exactly what `prism train` accepts, and returns each one in compact form."""
    if schedules in (None, [], ()):
        return [None]
    path = preset_path(arm, scale)
    if schedules == ALL_VALID:
        base = config.load(path, overrides)
        m, p = base.model, base.parallel
        found = [
            schedule.compact(h)
            for h in schedule.enumerate_valid(
                m.d_model, m.num_layers, m.h_base, p.tp, replicate_indivisible=p.replicate_indivisible_layers
            )
        ]
        if not found:
            raise ConfigError(f"sweep: schedules=all-valid found no valid schedule for {scale} (d_model {m.d_model})")
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
) -> list[GridRun]:
    """Every grid point (arm, scale, seed, schedule) as a run of pipeline.grid: its preset, the overrides that
    make it, its validated config."""
    for key, values in (("arms", arms), ("scales", scales), ("seeds", seeds)):
        if not values:
            raise ConfigError(f"sweep: {key} is empty; give at least one value")
    base_overrides = config.override_list(overrides)
    grid = []
    for arm, scale in itertools.product(arms, scales):
        per_arm = expand_schedules(schedules, arm, scale, base_overrides)
        grid += expand_grid([preset_path(arm, scale)], [int(s) for s in seeds], per_arm, base_overrides)
    return grid


class TrainJob(submitit.helpers.Checkpointable):
    """One grid point: `prism train CONFIG OVERRIDES` under torchrun on every node of the job."""

    def __init__(self, config_path: str, overrides: list[str], nproc_per_node: int = 0, grace_s: int = 150):
        self.config_path, self.overrides = config_path, list(overrides)
        self.nproc_per_node, self.grace_s = nproc_per_node, grace_s
        self._proc: subprocess.Popen | None = None

    def __getstate__(self) -> dict[str, Any]:  # the pickle submitit requeues must not hold the live process
        return {k: v for k, v in self.__dict__.items() if k != "_proc"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _proc=None)

    def command(self) -> list[str]:
        dist = submitit.helpers.TorchDistributedEnvironment()  # one task per node: rank = node rank
        nproc = self.nproc_per_node or _gpus_on_node() or 1
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={dist.world_size}",
            f"--node-rank={dist.rank}",
            f"--nproc-per-node={nproc}",
            f"--master-addr={node_address(dist.master_addr)}",
            f"--master-port={dist.master_port}",
            "-m",
            "pipeline.cli",
            "train",
            self.config_path,
            *self.overrides,
        ]

    def __call__(self) -> dict[str, Any]:
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            **recovery.torchrun_env(self.grace_s),
        }
        cmd = self.command()
        print("sweep job:", " ".join(cmd), flush=True)
        self._proc = subprocess.Popen(cmd, cwd=ROOT, env=env)
        while (rc := self._proc.poll()) is None:  # poll, not wait(): the signal handler reaps too
            time.sleep(0.5)
        if rc != 0:
            why = "stopped by a signal after a checkpoint" if rc == EXIT_STOPPED else "failed"
            raise RuntimeError(f"prism train {why} (exit {rc}); its log is this job's stdout/stderr")
        cfg = config.load(self.config_path, self.overrides)
        return {"run_name": cfg.run_name, "checkpoint_dir": str(cfg.checkpoint_dir), "exit_code": rc}

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        """Called by submitit on global rank 0 when the job is about to time out or is preempted."""
        proc = self._proc
        if proc is not None and proc.returncode is None:
            proc.send_signal(signal.SIGTERM)  # torchrun hands it to the workers; the trainer checkpoints
            deadline = time.monotonic() + self.grace_s + 15
            while not _reaped(proc):
                if time.monotonic() > deadline:
                    proc.kill()
                    break
                time.sleep(0.2)
        return super().checkpoint(*args, **kwargs)


def _reaped(proc: subprocess.Popen) -> bool:
    """Whether ``proc`` has exited, reaping it without Popen's lock: this runs in a signal handler that may
    have interrupted the job's own poll() while it held that lock. The same signal from `scancel` often
    reaches torchrun too, so it can already be dead, and reaped by send_signal's own poll()."""
    if proc.returncode is not None:
        return True
    try:
        pid, status = os.waitpid(proc.pid, os.WNOHANG)
    except ChildProcessError:  # reaped elsewhere: nothing is left to wait for
        return True
    if pid:
        proc.returncode = os.waitstatus_to_exitcode(status)
    return bool(pid)


def node_address(node: str) -> str:
    """The address Slurm reaches ``node`` at (its NodeAddr); the name itself where Slurm says nothing.

    On most clusters they are the same; on the local multi-node cluster every node is 127.0.0.1."""
    try:
        out = subprocess.run(["scontrol", "show", "node", node], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return node
    for field in out.stdout.split():
        if field.startswith("NodeAddr="):
            return field.split("=", 1)[1] or node
    return node


def _gpus_on_node() -> int:
    value = os.environ.get("SLURM_GPUS_ON_NODE", "0")
    return int(value) if value.isdigit() else 0


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


def first_result(job: Any) -> Any:
    """A job's result; a multi-node job has one task per node, all returning the same: take node 0's."""
    return job.results()[0]


# How many time-outs a sweep or search job requeues after (submitit's own default is 3). The 757M run is about
# 9 h on 8 GPUs, 3 time-outs of the default 4 h timeout_min, and about 72 h on one GPU, 18; 30 leaves room for
# slower nodes and bigger budgets. A job that stops making progress is ended by the trainer's crash and hang
# handling (docs/cluster.md), not by this bound. Preemptions do not count (submitit requeues those always).
MAX_NUM_TIMEOUT = 30


def make_executor(
    folder: Path,
    executor: str,
    *,
    nodes: int = 1,
    gpus_per_node: int = 0,
    cpus_per_task: int = 1,
    timeout_min: int = 240,
    partition: str | None = None,
    signal_delay_s: int = 180,
    array_parallelism: int = 256,
    job_name: str = "prism-sweep",
    additional_parameters: dict[str, Any] | None = None,
    max_num_timeout: int = MAX_NUM_TIMEOUT,
) -> submitit.Executor:
    if executor not in ("slurm", "local"):
        raise ConfigError(f"sweep: executor={executor!r}; use 'slurm' or 'local'")
    ex = submitit.AutoExecutor(
        folder=folder / "submitit" / "%j", cluster=executor, slurm_max_num_timeout=max_num_timeout
    )
    params: dict[str, Any] = {
        "nodes": nodes,
        "tasks_per_node": 1,
        "cpus_per_task": cpus_per_task,
        "timeout_min": timeout_min,
        "name": job_name,
        "slurm_signal_delay_s": signal_delay_s,
        "slurm_array_parallelism": array_parallelism,
    }
    if gpus_per_node:
        params["gpus_per_node"] = gpus_per_node
    if partition:
        params["slurm_partition"] = partition
    if additional_parameters:
        params["slurm_additional_parameters"] = dict(additional_parameters)
    if executor == "slurm":
        # srun no longer inherits sbatch's --cpus-per-task (Slurm >= 22.05): the step (torchrun, its workers
        # and their data loaders) would get one CPU per task.
        params["slurm_srun_args"] = [f"--cpus-per-task={cpus_per_task}"]
    ex.update_parameters(**params)
    return ex


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
    **executor_params: Any,
) -> Sweep:
    """Submit one job per grid point as one submitit job array; write the sweep manifest; return at once.

    executor_params go to make_executor (nodes, gpus_per_node, cpus_per_task, timeout_min, partition,
    signal_delay_s, array_parallelism, additional_parameters, max_num_timeout)."""
    grid = build_grid(arms, scales, seeds, schedules, overrides)
    folder = Path(folder) if folder else ROOT / "runs" / "sweeps" / name
    folder.mkdir(parents=True, exist_ok=True)
    ex = make_executor(folder, executor, job_name=f"prism-{name}", **executor_params)
    grace = max(30, int(executor_params.get("signal_delay_s", 180)) - 30)
    jobs = []
    with ex.batch():  # one sbatch --array for the whole grid
        for run in grid:
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
    "seeds",
    "schedules",
    "overrides",
    "executor",
    "folder",
    "nproc_per_node",
    "slurm",
)


def load_spec(path: str | Path) -> dict[str, Any]:
    """A sweep YAML: arms, scales, seeds, schedules (list | all-valid | null), overrides, executor, slurm:{...}.

    Every field is checked here, so a bad spec is one line naming the key and where it is (exit 2), never a
    traceback."""
    doc = SpecFile(path, "sweep spec", SPEC_KEYS)
    spec = doc.data

    for key in ("arms", "scales"):
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
    spec.setdefault("name", doc.path.stem)
    return spec


def grid_of_spec(spec: dict[str, Any]) -> list[GridRun]:
    """The grid a sweep spec (from ``load_spec``) describes."""
    return build_grid(spec["arms"], spec["scales"], spec["seeds"], spec.get("schedules"), spec.get("overrides"))


def grid_table(grid: list[GridRun]) -> str:
    """One line per grid point (what a dry run prints) and the job count."""
    rows = [f"{'#':>4}  {'arm':<8} {'scale':<6} {'seed':>6}  schedule   -> run name"]
    for i, run in enumerate(grid):
        r = run.cfg.run
        rows.append(
            f"{i:>4}  {r.arm:<8} {r.scale:<6} {r.seed:>6}  {schedule.compact(run.cfg.heads_per_layer)}  -> {run.name}"
        )
    rows.append(f"jobs: {len(grid)}")
    return "\n".join(rows)


def submit_spec(spec: dict[str, Any], executor: str | None = None) -> Sweep:
    """Submit a sweep spec (from ``load_spec``); ``executor`` overrides the spec's (default slurm)."""
    return submit(
        spec["arms"],
        spec["scales"],
        spec["seeds"],
        spec.get("schedules"),
        spec.get("overrides"),
        executor=executor or spec.get("executor", "slurm"),
        folder=spec.get("folder"),
        name=spec["name"],
        nproc_per_node=int(spec.get("nproc_per_node", 0)),
        **(spec.get("slurm") or {}),
    )

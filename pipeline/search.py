"""`prism search SPEC.yaml`: asynchronous successive halving (ASHA) over schedules, with real `prism train` runs.

Optuna decides: a study in its journal file (``<folder>/optuna-journal.log``, no database server) with
``SuccessiveHalvingPruner`` (or ``HyperbandPruner``) driven through ask/tell. This module is the small driver
around it: it asks for a trial, starts an ordinary `prism train` run for it (the full budget's LR schedule,
so a rung is a prefix of the full run), reads the run's val loss at the rung points (MLflow, else the run's
offline journal), reports it, and stops a pruned run with a stop signal (locally) or ``scancel`` (Slurm): the
run checkpoints and ends as any stopped run does. `prism train` knows nothing about Optuna.

Every launch is written down first (``<folder>/search.json``, replaced atomically: trial -> run folder,
pid or job id), so a driver killed at any point is resumed by ``--resume``: finished trials stay finished,
running ones are found again (their process or job), a trial asked but never started is started once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from launchers import sweep
from pipeline import config, schedule
from pipeline.atomic import write_atomic
from pipeline.config import ConfigError

SPEC_KEYS = (
    "name",
    "config",
    "overrides",
    "folder",
    "space",
    "rungs",
    "trials",
    "concurrency",
    "sampler",
    "pruner",
    "seed",
    "executor",
    "nproc_per_node",
    "slurm",
    "confirm",
)
SPACE_KEYS = ("schedules", "lr")
FILTER_KEYS = ("stages", "min_heads")
RUNG_KEYS = ("min_tokens", "reduction_factor", "full_tokens")
CONFIRM_KEYS = ("top_k", "seeds")
SAMPLERS = ("grid", "tpe", "random")
PRUNERS = ("asha", "hyperband")
STATE_FILE = "search.json"
OPTUNA_FILE = "optuna-journal.log"
EXIT_FILE = "exit-record.txt"  # what `prism train` writes into $PRISM_EXIT_FILE: "finished|signal|nonfinite STEP"
FINAL = ("complete", "pruned", "failed")


@dataclasses.dataclass(frozen=True)
class Rungs:
    min_tokens: int
    reduction_factor: int
    full_tokens: int

    @property
    def points(self) -> list[int]:
        """Tokens at every rung, the full budget last: min, min*eta, ..., full."""
        out = [self.min_tokens]
        while out[-1] < self.full_tokens:
            out.append(out[-1] * self.reduction_factor)
        return out


@dataclasses.dataclass
class SearchSpec:
    path: Path
    name: str
    config_path: Path
    overrides: list[str]
    folder: Path
    schedules: list[str]
    schedules_from: str  # how the list was made, for the console
    lr: tuple[float, float] | None
    rungs: Rungs
    trials: int
    concurrency: int
    sampler: str
    pruner: str
    seed: int
    executor: str
    nproc_per_node: int
    slurm: dict[str, Any]
    confirm_top_k: int
    confirm_seeds: int
    base: config.Config  # the base config with the spec's overrides


# --- the spec -------------------------------------------------------------------------------------------
def load_spec(path: str | Path) -> SearchSpec:
    """Read and check a search spec, field by field: a bad one is one line with its line and column."""
    doc = sweep.SpecFile(path, "search spec", SPEC_KEYS)
    spec = doc.data
    is_int = sweep.is_int

    def positive_int(key: str, default: int | None = None, minimum: int = 1) -> int:
        value = doc.value(key)
        if value is None and default is not None:
            return default
        if not (is_int(value) and value >= minimum):
            raise doc.bad(key, f"must be an integer >= {minimum}")
        return value

    def mapping(key: str, keys: tuple[str, ...], required: bool) -> dict[str, Any]:
        value = doc.value(key)
        if value is None and not required:
            return {}
        if not isinstance(value, dict):
            raise doc.bad(key, f"must be a mapping of {', '.join(keys)}")
        unknown = sorted(str(k) for k in value if k not in keys)
        if unknown:
            raise doc.error(f"{key}.{unknown[0]}", f"unknown key {key}.{unknown[0]}; allowed: {', '.join(keys)}", True)
        return value

    for key in ("name", "folder", "config"):
        if key in spec and not (isinstance(spec[key], str) and spec[key]):
            raise doc.bad(key, "must be a non-empty string")
    if "config" not in spec:
        raise doc.error("config", "config is missing: a preset such as configs/tiny_prism.yaml (or prism_124m)")
    config_path = resolve_config(spec["config"], doc.path.parent)
    if config_path is None:
        raise doc.bad("config", "no such YAML: give a path (relative to this spec or the cwd) or a preset name")
    overrides = spec.get("overrides")
    if not (overrides is None or isinstance(overrides, dict | list)):
        raise doc.bad("overrides", "use a mapping {dotted.key: value} or a list of 'dotted.key=value' strings")
    overrides = sweep._override_list(overrides)
    try:
        base = config.load(config_path, overrides)
    except ConfigError as e:
        raise doc.error("overrides" if overrides else "config", f"the base config does not load: {e}") from None
    if base.run.arm != "prism":
        raise doc.bad("config", "a schedule search needs a prism-arm config (the uniform arm has one schedule)")
    if not base.tracking.enabled:
        raise doc.error("overrides", "tracking.enabled is false: the search reads its trials' val loss from tracking")

    space = mapping("space", SPACE_KEYS, required=True)
    schedules, schedules_from = expand_schedules(doc, base, space.get("schedules", sweep.ALL_VALID))
    lr = None
    if space.get("lr") is not None:
        bounds = mapping("space.lr", ("low", "high"), required=True)
        low, high = bounds.get("low"), bounds.get("high")
        if not all(isinstance(v, int | float) and not isinstance(v, bool) and v > 0 for v in (low, high)):
            raise doc.bad("space.lr", "give positive numbers low and high, e.g. {low: 3.0e-4, high: 3.0e-3}")
        if not low < high:
            raise doc.bad("space.lr", "low must be below high")
        lr = (float(low), float(high))

    mapping("rungs", RUNG_KEYS, required=True)
    for key in RUNG_KEYS:
        if key not in spec["rungs"]:
            raise doc.error("rungs", f"rungs.{key} is missing; rungs need {', '.join(RUNG_KEYS)}")
    rungs = Rungs(
        positive_int("rungs.min_tokens"),
        positive_int("rungs.reduction_factor", minimum=2),
        positive_int("rungs.full_tokens"),
    )
    batch = base.train.batch_tokens
    if rungs.min_tokens % batch:
        raise doc.bad("rungs.min_tokens", f"must be a whole number of steps of train.batch_tokens={batch}")
    if rungs.points[-1] != rungs.full_tokens or len(rungs.points) < 2:
        below = rungs.points[-2] if len(rungs.points) > 1 else rungs.min_tokens
        raise doc.bad(
            "rungs.full_tokens",
            f"must be min_tokens x reduction_factor^k with k >= 1 (e.g. {below:,} or {rungs.points[-1]:,})",
        )

    sampler = spec.get("sampler", "grid")
    if sampler not in SAMPLERS:
        raise doc.bad("sampler", f"use one of {', '.join(SAMPLERS)}")
    trials = positive_int("trials", default=len(schedules) if sampler == "grid" else None)
    if sampler == "grid" and trials > len(schedules):
        raise doc.bad("trials", f"the grid sampler has {len(schedules)} schedules to try; ask for at most that")
    pruner = spec.get("pruner", "asha")
    if pruner not in PRUNERS:
        raise doc.bad("pruner", f"use {' or '.join(PRUNERS)}")
    if spec.get("executor", "local") not in ("local", "slurm"):
        raise doc.bad("executor", "use local or slurm")
    if "nproc_per_node" in spec and not (is_int(spec["nproc_per_node"]) and spec["nproc_per_node"] >= 0):
        raise doc.bad("nproc_per_node", "must be an integer >= 0 (0: one per GPU, 1 without GPUs)")
    sweep.check_slurm_section(doc)
    confirm = mapping("confirm", CONFIRM_KEYS, required=False)
    top_k = positive_int("confirm.top_k", default=0) if confirm else 0
    seeds = positive_int("confirm.seeds", default=3) if confirm else 0
    if top_k > trials:
        raise doc.bad("confirm.top_k", f"cannot exceed trials={trials}")
    name = spec.get("name", doc.path.stem)
    folder = Path(spec["folder"]) if "folder" in spec else Path(base.run.output_dir) / "searches" / name
    return SearchSpec(
        path=doc.path,
        name=name,
        config_path=config_path,
        overrides=overrides,
        folder=folder.expanduser().resolve(),
        schedules=schedules,
        schedules_from=schedules_from,
        lr=lr,
        rungs=rungs,
        trials=trials,
        concurrency=positive_int("concurrency", default=1),
        sampler=sampler,
        pruner=pruner,
        seed=positive_int("seed", default=0, minimum=0),
        executor=spec.get("executor", "local"),
        nproc_per_node=int(spec.get("nproc_per_node", 0)),
        slurm=dict(spec.get("slurm") or {}),
        confirm_top_k=top_k,
        confirm_seeds=seeds,
        base=base,
    )


def resolve_config(text: str, spec_dir: Path) -> Path | None:
    """A YAML path (relative to the spec, then the cwd) or a preset name (``prism_124m`` -> configs/prism_124m.yaml)."""
    for candidate in (spec_dir / text, Path(text), sweep.ROOT / "configs" / f"{text}.yaml", sweep.ROOT / text):
        if candidate.is_file():
            return candidate.resolve()
    return None


def expand_schedules(doc: sweep.SpecFile, base: config.Config, value: Any) -> tuple[list[str], str]:
    """all-valid | {stages: N, min_heads: H} (all-valid, filtered) | an explicit list; each checked on the base."""
    m = base.model
    shape = f"d_model {m.d_model}, {m.num_layers} layers, h_base {m.h_base}, TP {base.parallel.tp}"
    if value == sweep.ALL_VALID or isinstance(value, dict):
        found = [
            schedule.compact(h) for h in schedule.enumerate_valid(m.d_model, m.num_layers, m.h_base, base.parallel.tp)
        ]
        how = f"all-valid for {shape}"
        if isinstance(value, dict):
            unknown = sorted(str(k) for k in value if k not in FILTER_KEYS)
            if unknown:
                raise doc.error(
                    f"space.schedules.{unknown[0]}",
                    f"unknown filter {unknown[0]!r}; allowed: {', '.join(FILTER_KEYS)}",
                    True,
                )
            for key in FILTER_KEYS:
                if key not in value:
                    continue
                wanted = value[key] if isinstance(value[key], list) else [value[key]]
                if not wanted or not all(sweep.is_int(w) and w >= 1 for w in wanted):
                    raise doc.bad(f"space.schedules.{key}", "must be a positive integer or a list of them")

                def measure(s: str, key: str = key) -> int:
                    heads = schedule.parse(s)
                    return len(schedule.stages(heads)) if key == "stages" else min(heads)

                found = [s for s in found if measure(s) in wanted]
            how += ", " + ", ".join(f"{k} in {value[k]}" for k in FILTER_KEYS if k in value)
        if not found:
            raise doc.bad("space.schedules", f"no valid schedule of {shape} passes; loosen the filter")
        return found, how
    if not (isinstance(value, list) and value and all(isinstance(s, str) for s in value)):
        raise doc.bad(
            "space.schedules", f"use {sweep.ALL_VALID!r}, a filter {{stages: 3}} or a list of quoted schedules"
        )
    out = []
    for text in value:
        try:
            heads = schedule.parse(text)
            config.load(base.source, [*_base_overrides_of(base), f"schedule.heads={schedule.compact(heads)}"])
        except (schedule.ScheduleError, ConfigError) as e:
            raise doc.error("space.schedules", f"space.schedules: {text!r} does not fit the base config: {e}") from None
        out.append(schedule.compact(heads))
    if len(set(out)) != len(out):
        raise doc.bad("space.schedules", "lists a schedule twice")
    return out, "listed"


def _base_overrides_of(base: config.Config) -> list[str]:
    """The model/parallel keys a listed schedule is checked against (the rest cannot make it invalid)."""
    m = base.model
    return [
        f"model.d_model={m.d_model}",
        f"model.num_layers={m.num_layers}",
        f"model.h_base={m.h_base}",
        f"model.ffn_hidden_size={m.ffn_hidden_size}",
        f"model.seq_len={m.seq_len}",
        f"parallel.tp={base.parallel.tp}",
        f"train.batch_tokens={base.train.batch_tokens}",
        f"train.micro_batch_size={base.train.micro_batch_size}",
    ]


# --- what every run of the search is --------------------------------------------------------------------
def tracking_uri(spec: SearchSpec) -> str:
    """All trials log to one store: the base config's, or ``<folder>/mlflow.db`` when it names none."""
    from pipeline.tracking.store import resolve_uri

    return resolve_uri(spec.base.tracking.uri, spec.folder)


def _pathlike(value: str) -> str:
    """Absolute when it is a local path that exists (trials may run from another cwd, e.g. a Slurm job)."""
    return str(Path(value).resolve()) if "://" not in value and Path(value).exists() else value


def run_overrides(spec: SearchSpec, folder: Path, experiment: str, extra: list[str]) -> list[str]:
    """The overrides of one run of the search: the spec's, its own folder, the shared store and data."""
    d = spec.base.data
    return [
        *spec.overrides,
        f"data.dataset_dir={Path(d.dataset_dir).resolve()}",
        f"data.tokenizer={_pathlike(d.tokenizer)}",
        f"data.input={_pathlike(d.input)}",
        f"run.output_dir={folder}",
        f"tracking.uri={tracking_uri(spec)}",
        f"tracking.experiment={experiment}",
        f"train.train_tokens={spec.rungs.full_tokens}",
        *extra,
    ]


def val_every(spec: SearchSpec) -> int:
    """Validate at every rung: a step count dividing the first rung's (and so every rung's)."""
    return math.gcd(spec.base.train.val_every, spec.rungs.min_tokens // spec.base.train.batch_tokens)


def trial_overrides(spec: SearchSpec, number: int, sched: str, lr: float | None) -> list[str]:
    extra = [f"schedule.heads={sched}", f"train.val_every={val_every(spec)}"]
    if lr is not None:
        extra.append(f"train.lr={lr!r}")
    return run_overrides(spec, spec.folder / "trials" / trial_key(number), spec.name, extra)


def trial_key(number: int) -> str:
    return f"t{number:03d}"


# --- the dry run: what it will cost --------------------------------------------------------------------
def expected_tokens(spec: SearchSpec) -> int:
    """Tokens if every rung keeps exactly 1/eta of the trials reaching it (ASHA's asymptotic count)."""
    points, eta, n = spec.rungs.points, spec.rungs.reduction_factor, spec.trials
    total, reached = 0.0, float(n)
    for k, tokens in enumerate(points):
        promoted = reached / eta if k < len(points) - 1 else 0.0
        total += (reached - promoted) * tokens
        reached = promoted
    return int(round(total))


def dry_run(spec: SearchSpec, mfu: float = 0.4, peak_flops: float | None = None) -> str:
    from pipeline.budget import make_budget

    r, base = spec.rungs, spec.base
    cfg = config.load(spec.config_path, trial_overrides(spec, 0, spec.schedules[0], None))
    nodes = int(spec.slurm.get("nodes", 1))
    gpus = int(spec.slurm.get("gpus_per_node", 1)) or 1
    plan = make_budget(cfg, nodes, gpus, mfu, peak_flops)
    search = expected_tokens(spec)
    grid = len(spec.schedules) * r.full_tokens
    confirm_runs = (spec.confirm_top_k + 1) * spec.confirm_seeds
    steps = [t // base.train.batch_tokens for t in r.points]
    lines = [
        f"prism search {spec.name}: {spec.path}",
        f"  base         {_shown(spec.config_path)} ({base.run.scale}, {base.model.num_layers} layers, d_model "
        f"{base.model.d_model}) + {len(spec.overrides)} overrides",
        f"  space        {len(spec.schedules)} schedules ({spec.schedules_from})"
        + (f", lr log-uniform in [{spec.lr[0]:g}, {spec.lr[1]:g}]" if spec.lr else ""),
        f"  trials       {spec.trials}, {spec.concurrency} at a time on {spec.executor}; sampler {spec.sampler}, "
        f"pruner {'SuccessiveHalving (ASHA)' if spec.pruner == 'asha' else 'Hyperband'}, seed {spec.seed}",
        f"  rungs        {' -> '.join(f'{t:,}' for t in r.points)} tokens ({' / '.join(map(str, steps))} steps), "
        f"reduction factor {r.reduction_factor}; every trial uses the {r.full_tokens:,}-token LR schedule",
        f"  tokens       ~{search:,} expected (1/{r.reduction_factor} promoted per rung) against the full grid's "
        f"{len(spec.schedules)} x {r.full_tokens:,} = {grid:,} ({search / grid:.0%})",
    ]
    if confirm_runs:
        lines.append(
            f"  confirm      top {spec.confirm_top_k} + uniform x {spec.confirm_seeds} seeds = {confirm_runs} runs x "
            f"{r.full_tokens:,} = {confirm_runs * r.full_tokens:,} tokens"
        )
    if plan.wall_seconds is None:
        lines.append(
            f"  GPU hours    unknown: pass --peak-tflops (FLOPs/token {plan.flops_per_token:,} from prism plan)"
        )
    else:
        per_token = plan.wall_seconds * plan.world / plan.tokens / 3600  # GPU hours per token at this MFU
        lines.append(
            f"  GPU hours    search ~{search * per_token:,.1f}, full grid {grid * per_token:,.1f}"
            + (f", confirmation {confirm_runs * r.full_tokens * per_token:,.1f}" if confirm_runs else "")
            + f" at MFU {mfu:.0%} of {plan.peak_flops / 1e12:,.0f} TFLOP/s ({plan.flops_per_token:,} FLOPs/token, "
            f"prism plan); one trial: {_hours(plan.wall_seconds)} on {plan.world} GPU(s)"
        )
    return "\n".join(lines)


def _shown(path: Path) -> str:
    """A path as the user would type it: relative to the cwd when it lies below it."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _hours(seconds: float) -> str:
    h, rest = divmod(round(seconds), 3600)
    return f"{h}h {rest // 60:02d}m" if h else f"{rest // 60}m {rest % 60:02d}s"


# --- the driver's record: search.json -------------------------------------------------------------------
class State:
    """``<folder>/search.json``: the parent MLflow run and one record per run the search started."""

    def __init__(self, folder: Path):
        self.path = folder / STATE_FILE
        self.data: dict[str, Any] = json.loads(self.path.read_text()) if self.path.is_file() else {"runs": {}}

    @property
    def runs(self) -> dict[str, dict[str, Any]]:
        return self.data["runs"]

    def save(self) -> None:
        write_atomic(self.path, json.dumps(self.data, indent=1) + "\n")


# --- launching and stopping runs ------------------------------------------------------------------------
def _proc_start(pid: int) -> str | None:
    """The process's start time in clock ticks (field 22 of /proc/PID/stat), None when gone or a zombie:
    with the pid it names one process, so a recycled pid is not taken for a trial."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields[19]


def _find_local(marker: str) -> int | None:
    """A live process whose command line holds ``marker`` (a run's own folder override)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if marker.encode() in args and _proc_start(int(entry.name)):
            return int(entry.name)
    return None


class LocalLauncher:
    """`prism train` subprocesses on this host, each in its own session: a driver killed by Ctrl-C or a
    signal leaves them training, and the next driver finds them by pid (and start time) again."""

    def __init__(self, spec: SearchSpec):
        self.spec = spec
        self.children: dict[int, subprocess.Popen] = {}
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if "OMP_NUM_THREADS" not in self.env:  # share the cores instead of each run taking all of them
            self.env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // spec.concurrency))

    def find(self, rec: dict[str, Any]) -> dict[str, Any] | None:
        pid = _find_local(rec["marker"])
        return None if pid is None else {"pid": pid, "start": _proc_start(pid)}

    def start(self, rec: dict[str, Any]) -> dict[str, Any]:
        folder = Path(rec["folder"])
        folder.mkdir(parents=True, exist_ok=True)
        (folder / EXIT_FILE).unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "pipeline.cli", "train", rec["config"], *rec["overrides"]]
        env = {**self.env, "PRISM_EXIT_FILE": str(folder / EXIT_FILE)}
        with open(folder / "train.log", "a") as log:
            proc = subprocess.Popen(
                cmd, cwd=sweep.ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.children[proc.pid] = proc
        return {"pid": proc.pid, "start": _proc_start(proc.pid)}

    def alive(self, rec: dict[str, Any]) -> bool:
        pid = rec["handle"]["pid"]
        if pid in self.children:
            return self.children[pid].poll() is None  # also reaps it
        return _proc_start(pid) == rec["handle"]["start"]

    def stop(self, rec: dict[str, Any]) -> None:
        if self.alive(rec):
            with contextlib.suppress(ProcessLookupError):
                os.kill(rec["handle"]["pid"], signal.SIGUSR1)  # prism train: checkpoint, exit 3

    def describe(self, rec: dict[str, Any]) -> str:
        return f"pid {rec['handle']['pid']}"


class SlurmLauncher:
    """One submitit job per run (the sweep's TrainJob and executor settings); a pruned job is scancel'ed:
    Slurm sends SIGTERM to its steps, `prism train` checkpoints and ends before the KillWait runs out."""

    def __init__(self, spec: SearchSpec):
        self.spec = spec
        self.submitit_folder = spec.folder / "submitit" / "%j"

    def job_name(self, rec: dict[str, Any]) -> str:
        return f"prism-{self.spec.name}-{rec['key']}"

    def _job(self, rec: dict[str, Any]) -> Any:
        import submitit

        return submitit.SlurmJob(folder=self.submitit_folder, job_id=rec["handle"]["job_id"])

    def find(self, rec: dict[str, Any]) -> dict[str, Any] | None:
        out = subprocess.run(
            ["squeue", "-h", "--name", self.job_name(rec), "-o", "%i"], capture_output=True, text=True, timeout=60
        )
        ids = out.stdout.split()
        return {"job_id": ids[0]} if out.returncode == 0 and ids else None

    def start(self, rec: dict[str, Any]) -> dict[str, Any]:
        params = dict(self.spec.slurm)
        grace = max(30, int(params.get("signal_delay_s", 180)) - 30)
        ex = sweep.make_executor(self.spec.folder, "slurm", job_name=self.job_name(rec), **params)
        job = ex.submit(sweep.TrainJob(rec["config"], rec["overrides"], self.spec.nproc_per_node, grace))
        return {"job_id": str(job.job_id)}

    def alive(self, rec: dict[str, Any]) -> bool:
        return not self._job(rec).done()

    def stop(self, rec: dict[str, Any]) -> None:
        self._job(rec).cancel(check=False)

    def describe(self, rec: dict[str, Any]) -> str:
        return f"job {rec['handle']['job_id']}"


# --- reading a run ---------------------------------------------------------------------------------------
def read_journal(rec: dict[str, Any]) -> list[dict[str, Any]]:
    from pipeline.tracking.journal import Journal

    return Journal(rec["checkpoint_dir"]).records()


def run_id_of(rec: dict[str, Any]) -> str | None:
    from pipeline.tracking.journal import journal_run_id

    return journal_run_id(rec["checkpoint_dir"])


_CLIENTS: dict[str, Any] = {}  # one MLflow client per store for the driver's polls


def val_losses(rec: dict[str, Any], uri: str) -> tuple[dict[int, float], str]:
    """{step: val loss} of a run and where it came from: MLflow, with what its journal holds beyond that
    (records not delivered yet); the journal alone when the store cannot be read."""
    from pipeline.compare import latest_per_step
    from pipeline.tracking import store

    from_journal: dict[int, float] = {}
    for r in read_journal(rec):
        if r.get("op") == "metrics" and "val/loss" in r["metrics"]:
            from_journal[int(r["step"])] = float(r["metrics"]["val/loss"])
    run_id = run_id_of(rec)
    if run_id is None:
        return from_journal, "journal"
    try:
        if uri not in _CLIENTS:
            _CLIENTS[uri] = store.client(uri)
        values = latest_per_step(_CLIENTS[uri].get_metric_history(run_id, "val/loss"))
    except Exception:  # noqa: BLE001 - the store is down or locked: the journal is the record
        return from_journal, "journal"
    return {**from_journal, **values}, "mlflow"


def outcome(rec: dict[str, Any]) -> tuple[str, int]:
    """How an ended run ended: (finished | signal | nonfinite | crashed, last step), from its exit record,
    else its journal's last finish record."""
    exit_file = Path(rec["folder"]) / EXIT_FILE
    if exit_file.is_file():
        reason, _, step = exit_file.read_text().strip().partition(" ")
        return reason, int(step or 0)
    steps = [int(r["step"]) for r in read_journal(rec) if r.get("op") == "metrics"]
    finish = [r for r in read_journal(rec) if r.get("op") == "finish"]
    status = finish[-1]["status"] if finish else "CRASHED"
    reason = {"FINISHED": "finished", "KILLED": "signal", "FAILED": "nonfinite"}.get(status, "crashed")
    return reason, max(steps, default=0)


def tokens_trained(rec: dict[str, Any], batch_tokens: int) -> int:
    """Tokens a run trained: its last logged count, or its last step (a stop signal's checkpoint, the exit
    record) when that is later: a pruned run trains on to the next step boundary before it stops."""
    seen = [
        r["metrics"]["train/tokens_seen"]
        for r in read_journal(rec)
        if r.get("op") == "metrics" and "train/tokens_seen" in r.get("metrics", {})
    ]
    steps = [int(name.split("-")[1]) for name in checkpoints_of(rec)]
    exit_file = Path(rec["folder"]) / EXIT_FILE
    words = exit_file.read_text().split() if exit_file.is_file() else []
    if len(words) == 2 and words[1].isdigit():
        steps.append(int(words[1]))
    return int(max(max(seen, default=0), max(steps, default=0) * batch_tokens))


def checkpoints_of(rec: dict[str, Any]) -> list[str]:
    folder = Path(rec["checkpoint_dir"])
    return sorted(p.name for p in folder.glob("step-*") if p.is_dir()) if folder.is_dir() else []


# --- the driver ------------------------------------------------------------------------------------------
class Driver:
    def __init__(self, spec: SearchSpec, resume: bool, say: Any = print, poll_s: float = 1.0):
        import optuna
        from optuna.storages import JournalStorage
        from optuna.storages.journal import JournalFileBackend

        self.spec, self.say, self.poll_s = spec, say, poll_s
        self.t0 = time.monotonic()
        exists = (spec.folder / STATE_FILE).is_file() or (spec.folder / OPTUNA_FILE).is_file()
        if exists and not resume:
            raise ConfigError(f"{spec.folder} already holds search {spec.name!r}; continue it with --resume")
        if resume and not exists:
            raise ConfigError(f"--resume: {spec.folder} holds no search yet; run without --resume to start it")
        spec.folder.mkdir(parents=True, exist_ok=True)
        self.state = State(spec.folder)
        self.uri = tracking_uri(spec)
        optuna.logging.set_verbosity(optuna.logging.WARNING)  # the driver prints each event itself
        storage = JournalStorage(JournalFileBackend(str(spec.folder / OPTUNA_FILE)))
        self.study = optuna.create_study(
            study_name=spec.name,
            storage=storage,
            sampler=make_sampler(spec),
            pruner=make_pruner(spec),
            direction="minimize",
            load_if_exists=True,
        )
        self.launcher: Any = LocalLauncher(spec) if spec.executor == "local" else SlurmLauncher(spec)
        if spec.sampler == "grid":
            self.enqueue_grid()
        self.best: tuple[float, str] | None = None

    def enqueue_grid(self) -> None:
        """The grid sampler: every schedule queued once (Optuna's enqueue_trial), in an order the seed
        shuffles; a searched lr is still drawn by the sampler. Idempotent, so a resume queues only what a
        killed driver had not queued yet. (Optuna's GridSampler stops the study from inside tell(), which
        only works under study.optimize, not with ask/tell.)"""
        import random

        queued = {t.system_attrs.get("fixed_params", {}).get("schedule") for t in self.study.get_trials(deepcopy=False)}
        order = list(self.spec.schedules)
        random.Random(self.spec.seed).shuffle(order)
        for sched in order[: self.spec.trials]:
            if sched not in queued:
                self.study.enqueue_trial({"schedule": sched}, skip_if_exists=False)

    # -- records
    def new_record(
        self, key: str, kind: str, overrides: list[str], status: str = "launching", **extra: Any
    ) -> dict[str, Any]:
        cfg = config.load(self.spec.config_path, overrides)
        rec = {
            "key": key,
            "kind": kind,
            "config": str(self.spec.config_path),
            "overrides": overrides,
            "folder": str(Path(cfg.run.output_dir)),
            "marker": f"run.output_dir={cfg.run.output_dir}",
            "run_dir": str(cfg.run_dir),
            "checkpoint_dir": str(cfg.checkpoint_dir),
            "status": status,  # launching (written just before the launch) | queued | running | stopping | FINAL
            "handle": None,
            **extra,
        }
        self.state.runs[key] = rec
        self.state.save()  # before the launch: a driver killed now looks for the run before starting one
        return rec

    def launch(self, rec: dict[str, Any]) -> None:
        found = self.launcher.find(rec)  # started by a driver killed before it wrote the pid down
        rec["handle"] = found or self.launcher.start(rec)
        rec["status"] = "running"
        self.state.save()
        how = "found running" if found else "launched"
        self.say(f"  {self.label(rec)}: {how}, {self.launcher.describe(rec)} -> {rec['run_dir']}")

    def label(self, rec: dict[str, Any]) -> str:
        lr = f", lr {rec['lr']:.2e}" if rec.get("lr") is not None else ""
        return f"{rec['key']} [{rec['schedule']}{lr}]"

    # -- the search
    def ask(self) -> dict[str, Any]:
        trial = self.study.ask(fixed_distributions=self.distributions())
        return self.record_for(trial.number, trial.params)

    def distributions(self) -> dict[str, Any]:
        from optuna.distributions import CategoricalDistribution, FloatDistribution

        dists: dict[str, Any] = {"schedule": CategoricalDistribution(self.spec.schedules)}
        if self.spec.lr:
            dists["lr"] = FloatDistribution(*self.spec.lr, log=True)
        return dists

    def record_for(self, number: int, params: dict[str, Any]) -> dict[str, Any]:
        sched, lr = params["schedule"], params.get("lr")
        overrides = trial_overrides(self.spec, number, sched, lr)
        return self.new_record(trial_key(number), "trial", overrides, trial=number, schedule=sched, lr=lr)

    def trial(self, rec: dict[str, Any]) -> Any:
        import optuna

        frozen = self.study.get_trials(deepcopy=False)[rec["trial"]]
        return optuna.trial.Trial(self.study, frozen._trial_id), frozen

    def adopt(self) -> None:
        """On --resume: every run of the last driver found again, every asked trial started exactly once."""
        from optuna.trial import TrialState

        for rec in self.state.runs.values():
            if rec["status"] == "launching":
                self.launch(rec)
            elif rec["status"] in ("running", "stopping"):
                alive = self.launcher.alive(rec)
                self.say(
                    f"  {self.label(rec)}: {rec['status']}, {self.launcher.describe(rec)} {'still running' if alive else 'ended meanwhile'}"
                )
        known = {rec.get("trial") for rec in self.state.runs.values()}
        for frozen in self.study.get_trials(deepcopy=False):
            if frozen.state != TrialState.RUNNING or frozen.number in known:
                continue
            if "schedule" not in frozen.params:  # the driver died inside ask(): nothing was started for it
                self.study.tell(frozen.number, state=TrialState.FAIL, skip_if_finished=True)
                continue
            self.launch(self.record_for(frozen.number, frozen.params))

    def step(self, rec: dict[str, Any]) -> None:
        """Report what a running trial measured since the last look; prune it or close it when it ended."""
        from optuna.trial import TrialState

        alive = self.launcher.alive(rec)  # before reading: a run that ended has all its values written
        trial, frozen = self.trial(rec)
        if rec["status"] == "running" and frozen.state == TrialState.RUNNING:
            values, source = val_losses(rec, self.uri)
            batch = self.spec.base.train.batch_tokens
            for tokens in self.spec.rungs.points[:-1]:  # the last rung is the full budget: nothing to prune
                step = tokens // batch
                if step not in values or tokens in frozen.intermediate_values:
                    continue
                trial.report(values[step], tokens)
                rec.setdefault("rungs", {})[str(tokens)] = values[step]
                if trial.should_prune():
                    self.study.tell(trial, state=TrialState.PRUNED, skip_if_finished=True)
                    rec["status"] = "stopping"
                    self.state.save()
                    self.launcher.stop(rec)
                    self.say(
                        f"  {self.label(rec)}: pruned at {tokens:,} tokens (val {values[step]:.4f}, from {source}); "
                        f"stopping {self.launcher.describe(rec)}"
                    )
                    break
                self.say(
                    f"  {self.label(rec)}: rung {tokens:,} tokens, val {values[step]:.4f} (from {source}): continues"
                )
            self.state.save()
        elif rec["status"] == "running":  # told by the last driver, not yet marked here
            rec["status"] = "stopping" if frozen.state == TrialState.PRUNED else rec["status"]
        if rec["status"] == "stopping" and alive:
            self.launcher.stop(rec)  # idempotent: a second stop signal only sets the flag again
        if alive:
            return
        self.finish(rec, trial, frozen)

    def finish(self, rec: dict[str, Any], trial: Any, frozen: Any) -> None:
        from optuna.trial import TrialState

        reason, last_step = outcome(rec)
        rec["tokens"] = tokens_trained(rec, self.spec.base.train.batch_tokens)
        rec["checkpoints"] = checkpoints_of(rec)
        values, _ = val_losses(rec, self.uri)
        full_step = self.spec.rungs.full_tokens // self.spec.base.train.batch_tokens
        if rec["status"] == "stopping":
            rec["status"] = "pruned"
            self.say(
                f"  {self.label(rec)}: ended ({reason} at step {last_step}, checkpoint {', '.join(rec['checkpoints'][-1:]) or 'none'})"
            )
        elif reason == "finished" and full_step in values:
            rec["status"], rec["final_val"] = "complete", values[full_step]
            self.study.tell(trial, values[full_step], skip_if_finished=True)
            best = self.study.best_trial
            self.say(
                f"  {self.label(rec)}: complete, val {values[full_step]:.4f}"
                + (
                    " (best so far)"
                    if best.number == rec["trial"]
                    else f" (best: {trial_key(best.number)} {best.value:.4f})"
                )
            )
        else:
            rec["status"] = "failed"
            if frozen.state == TrialState.RUNNING:
                self.study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)
            self.say(f"  {self.label(rec)}: failed ({reason} at step {last_step}); its log: {rec['folder']}/train.log")
        self.state.save()

    def summary(self) -> str:
        trials = [r for r in self.state.runs.values() if r["kind"] == "trial"]
        count = {
            s: sum(r["status"] == s for r in trials) for s in ("running", "stopping", "pruned", "complete", "failed")
        }
        spent = sum(tokens_trained(r, self.spec.base.train.batch_tokens) for r in trials)
        grid = len(self.spec.schedules) * self.spec.rungs.full_tokens
        complete = [r for r in trials if r["status"] == "complete"]
        best = min(complete, key=lambda r: r["final_val"]) if complete else None
        best_text = (
            f"best {best['key']} {best['schedule']} val {best['final_val']:.4f}" if best else "best: none complete yet"
        )
        return (
            f"  -- {len(trials)}/{self.spec.trials} trials: {count['running'] + count['stopping']} running, "
            f"{count['pruned']} pruned, {count['complete']} complete, {count['failed']} failed | {best_text} | "
            f"tokens {spent:,} of the full grid's {grid:,} ({spent / grid:.1%}) [{_elapsed(self.t0)}]"
        )

    def run(self) -> int:
        from optuna.trial import TrialState

        s = self.spec
        self.say(
            f"prism search {s.name}: {s.trials} trials over {len(s.schedules)} schedules, {s.concurrency} at a time "
            f"({s.executor}); rungs {' -> '.join(f'{t:,}' for t in s.rungs.points)} tokens -> {s.folder}"
        )
        if s.executor == "local":
            from data_prep.build import prepare

            prepare(s.base)  # the data config as the spec spells it, so every rerun compares equal to the build
        self.parent_run()
        self.adopt()
        last = ""
        while True:
            for rec in list(self.state.runs.values()):
                if rec["kind"] == "trial" and rec["status"] in ("running", "stopping"):
                    self.step(rec)
            self.tag_children()
            active = [r for r in self.state.runs.values() if r["status"] in ("running", "stopping", "launching")]
            asked = sum(t.state != TrialState.WAITING for t in self.study.get_trials(deepcopy=False))
            while len(active) < s.concurrency and asked < s.trials:
                rec = self.ask()
                self.launch(rec)
                active.append(rec)
                asked += 1
            line = self.summary()
            counts = line.split(" | tokens")[0]  # a new line when a trial changes state, not per step
            if counts != last:
                self.say(line)
                last = counts
            if not active and asked >= s.trials:
                break
            time.sleep(self.poll_s)
        results = self.results()
        if s.confirm_top_k:
            return self.confirm(results)
        return 0

    # -- MLflow: the parent run and its children
    def parent_run(self) -> None:
        if self.state.data.get("parent_run_id"):
            return
        from pipeline.tracking import store
        from pipeline.tracking.journal import Delivery, Journal

        try:
            delivery = Delivery(self.uri, self.spec.name, Journal(self.spec.folder))
            run = store.client(self.uri).create_run(
                delivery.experiment_id(),
                run_name=f"search-{self.spec.name}",
                tags={"kind": "search", "search": self.spec.name, "spec": str(self.spec.path)},
            )
            self.state.data["parent_run_id"] = run.info.run_id
            self.state.save()
        except Exception as e:  # noqa: BLE001 - a search never stops for tracking
            self.say(f"  (MLflow parent run not created: {str(e).splitlines()[0][:160]}; trials still log)")

    def tag_children(self) -> None:
        parent = self.state.data.get("parent_run_id")
        if not parent:
            return
        from pipeline.tracking import store

        for rec in self.state.runs.values():
            if rec["kind"] != "trial" or rec.get("tagged"):
                continue
            run_id = run_id_of(rec)
            if run_id is None:
                continue
            try:
                client = store.client(self.uri)
                for key, value in (
                    ("mlflow.parentRunId", parent),
                    ("search", self.spec.name),
                    ("search.trial", str(rec["trial"])),
                    ("mlflow.runName", f"{self.spec.name}-{rec['key']}"),
                ):
                    client.set_tag(run_id, key, value)
                rec["tagged"] = True
                self.state.save()
            except Exception:  # noqa: BLE001 - tried again at the next look
                return

    # -- results
    def results(self) -> list[dict[str, Any]]:
        trials = sorted((r for r in self.state.runs.values() if r["kind"] == "trial"), key=lambda r: r["trial"])
        points = self.spec.rungs.points
        head = ["trial", "schedule", "lr", "state", "rungs reached", *[f"val @ {t:,}" for t in points], "tokens"]
        rows = []
        for r in trials:
            r["tokens"] = tokens_trained(r, self.spec.base.train.batch_tokens)
            vals = [r.get("rungs", {}).get(str(t)) for t in points[:-1]] + [r.get("final_val")]
            reached = sum(v is not None for v in vals)
            rows.append(
                [
                    r["key"],
                    r["schedule"],
                    f"{r['lr']:.2e}" if r.get("lr") is not None else "base",
                    r["status"],
                    f"{reached}/{len(points)}",
                    *[f"{v:.4f}" if v is not None else "" for v in vals],
                    f"{r.get('tokens', 0):,}",
                ]
            )
        table = "\n".join(
            ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(row) + " |" for row in rows]
        )
        spent = sum(r.get("tokens", 0) for r in trials)
        grid = len(self.spec.schedules) * self.spec.rungs.full_tokens
        complete = [r for r in trials if r["status"] == "complete"]
        best = min(complete, key=lambda r: r["final_val"]) if complete else None
        text = (
            f"## Search {self.spec.name}\n\n{table}\n\n"
            f"Tokens trained: {spent:,} against {grid:,} for the full grid ({spent / grid:.1%}). "
            + (
                f"Best: {best['key']} {best['schedule']} (val {best['final_val']:.4f}).\n"
                if best
                else "No trial completed.\n"
            )
        )
        out = self.spec.folder
        write_atomic(out / "results.md", text)
        write_atomic(
            out / "results.csv", "\n".join(",".join(c.replace(",", ";") for c in row) for row in [head, *rows]) + "\n"
        )
        paths = [out / "results.md", out / "results.csv", self.plot(trials)]
        self.say(text)
        for p in paths:
            self.say(f"wrote {p}")
        self.log_results(paths, best, spent, grid)
        return complete

    def plot(self, trials: list[dict[str, Any]]) -> Path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        batch = self.spec.base.train.batch_tokens
        fig, ax = plt.subplots(figsize=(7, 4.4))
        for r in trials:
            values, _ = val_losses(r, self.uri)
            steps = sorted(values)
            style = "-" if r["status"] == "complete" else "--"
            ax.plot(
                [s * batch for s in steps],
                [values[s] for s in steps],
                style,
                marker="o",
                ms=3,
                label=f"{r['key']} {r['schedule']} ({r['status']})",
            )
        for t in self.spec.rungs.points:
            ax.axvline(t, color="grey", lw=0.6)
        ax.set(
            xlabel="training tokens",
            ylabel="validation loss (nats/token)",
            title=f"search {self.spec.name}: val loss per trial (grey: rungs)",
        )
        ax.legend(fontsize=6)
        ax.grid(alpha=0.3)
        path = self.spec.folder / "results.png"
        fig.tight_layout()
        tmp = path.with_name("results.tmp.png")
        fig.savefig(tmp, dpi=110)
        plt.close(fig)
        tmp.replace(path)
        return path

    def log_results(self, paths: list[Path], best: dict[str, Any] | None, spent: int, grid: int) -> None:
        parent = self.state.data.get("parent_run_id")
        if not parent:
            return
        from pipeline.tracking import store

        try:
            client = store.client(self.uri)
            for p in paths:
                client.log_artifact(parent, str(p), "search")
            client.log_metric(parent, "search/tokens", spent)
            client.log_metric(parent, "search/grid_tokens", grid)
            if best:
                client.log_metric(parent, "search/best_val", best["final_val"])
                client.set_tag(parent, "best_schedule", best["schedule"])
            client.set_terminated(parent)
        except Exception as e:  # noqa: BLE001
            self.say(
                f"  (results not logged to MLflow: {str(e).splitlines()[0][:160]}; they are in {self.spec.folder})"
            )

    # -- the confirmation stage
    def confirm(self, complete: list[dict[str, Any]]) -> int:
        from pipeline.compare import compare_arms

        s = self.spec
        top = sorted(complete, key=lambda r: r["final_val"])[: s.confirm_top_k]
        if not top:
            self.say("prism search: no trial completed; no confirmation stage")
            return 1
        experiment = f"{s.name}-confirm"
        uniform = f"{s.base.model.h_base}x{s.base.model.num_layers}"
        arms = [("prism", r["schedule"], r.get("lr")) for r in top] + [("uniform", uniform, None)]
        self.say(
            f"prism search: confirmation: {', '.join(a[1] for a in arms)} x {s.confirm_seeds} seeds -> experiment {experiment}"
        )
        for seed in range(1, s.confirm_seeds + 1):
            for arm, sched, lr in arms:
                key = f"c-{arm}-{sched.replace(',', '_')}-s{seed}"
                if key in self.state.runs:
                    continue
                extra = [f"run.arm={arm}", f"schedule.heads={sched}", f"run.seed={seed}"] + (
                    [f"train.lr={lr!r}"] if lr else []
                )
                folder = s.folder / "confirm" / f"{arm}-{sched.replace(',', '_')}"
                self.new_record(
                    key, "confirm", run_overrides(s, folder, experiment, extra), "queued", schedule=sched, lr=lr
                )
        while True:
            pending = [r for r in self.state.runs.values() if r["kind"] == "confirm" and r["status"] not in FINAL]
            for rec in pending:
                if rec["status"] == "running" and not self.launcher.alive(rec):
                    reason, step = outcome(rec)
                    rec["status"] = "complete" if reason == "finished" else "failed"
                    self.state.save()
                    self.say(f"  {self.label(rec)}: {reason} at step {step}")
            running = [r for r in pending if r["status"] == "running"]
            for rec in pending:
                if rec["status"] == "queued" and len(running) < s.concurrency:
                    rec["status"] = "launching"
                    self.state.save()
                    self.launch(rec)
                    running.append(rec)
            if not any(r["status"] not in FINAL for r in self.state.runs.values() if r["kind"] == "confirm"):
                break
            time.sleep(self.poll_s)
        result = compare_arms(experiment, self.uri, s.folder / "confirm" / "compare")
        self.say(result["table"])
        failed = [r["key"] for r in self.state.runs.values() if r["kind"] == "confirm" and r["status"] == "failed"]
        return 1 if failed else 0


def make_sampler(spec: SearchSpec) -> Any:
    import optuna

    if spec.sampler == "random" or (spec.sampler == "grid" and not spec.lr):
        return optuna.samplers.RandomSampler(seed=spec.seed)
    return optuna.samplers.TPESampler(seed=spec.seed)


def make_pruner(spec: SearchSpec) -> Any:
    import optuna

    r = spec.rungs
    if spec.pruner == "hyperband":
        return optuna.pruners.HyperbandPruner(r.min_tokens, r.full_tokens, r.reduction_factor)
    return optuna.pruners.SuccessiveHalvingPruner(min_resource=r.min_tokens, reduction_factor=r.reduction_factor)


def run_search(spec: SearchSpec, resume: bool = False, poll_s: float = 1.0) -> int:
    driver = Driver(spec, resume, poll_s=poll_s)
    try:
        return driver.run()
    except KeyboardInterrupt:  # the runs live in their own sessions: they go on without the driver
        running = [driver.launcher.describe(r) for r in driver.state.runs.values() if r["status"] == "running"]
        print(
            f"prism search: driver stopped; {len(running)} runs keep going ({', '.join(running) or 'none'}); "
            f"`prism search {spec.path} --resume` picks them up",
            flush=True,
        )
        return 130


def _elapsed(t0: float) -> str:
    s = int(time.monotonic() - t0)
    return f"{s // 60} min {s % 60:02d} s"

"""`prism study CONFIG... --seeds N`: every config (arm, schedule) x every seed, trained one after another on
this machine, then the comparison with statistics over seeds (pipeline.compare).

Each run is its own `prism train` subprocess (a clean process group and the real DeepSpeed path, like the
demo). Runs go seed by seed, arms interleaved, so a study stopped early still holds complete pairs and a busy
spell of the machine hits both arms alike. A run whose MLflow run already FINISHED with the same result_hash is
skipped, an interrupted one resumes from its checkpoint: rerunning the command finishes the study.
Same seed = same data order (pipeline.data) and same initial RNG state, so compare pairs the arms by seed.
"""

from __future__ import annotations

import time
from pathlib import Path

from pipeline.config import ConfigError
from pipeline.console import duration
from pipeline.runs.launch import LocalPool
from pipeline.runs.plan import GridRun, expand_grid, finished_run_ids


def parse_seeds(text: str) -> list[int]:
    """'3' -> [1, 2, 3]; '5,6,7' -> [5, 6, 7]; '10-12' -> [10, 11, 12]."""
    try:
        if "," in text:
            seeds = [int(s) for s in text.split(",") if s.strip()]
        elif "-" in text.strip()[1:]:
            lo, hi = text.split("-", 1)
            seeds = list(range(int(lo), int(hi) + 1))
        else:
            seeds = list(range(1, int(text) + 1))
    except ValueError:
        raise ConfigError(f"--seeds {text!r}: give a count (3), a list (1,2,3) or a range (1-3)") from None
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise ConfigError(f"--seeds {text!r}: needs at least one seed, no repeats, none negative")
    return seeds


def study_runs(configs: list[str], seeds: list[int], overrides: list[str]) -> list[GridRun]:
    """Every (seed, config) run, seed-major; every run must log to one experiment and store."""
    from pipeline.tracking.store import run_uri

    runs = expand_grid(configs, seeds, overrides=overrides)
    places = {(r.cfg.experiment, run_uri(r.cfg)) for r in runs}
    data = {ladder_data(r.cfg) for r in runs}
    if len({u for _, u in places}) > 1 or (len(places) > 1 and len(data) > 1):
        listed = "; ".join(f"{e} in {u}" for e, u in sorted(places))
        raise ConfigError(
            f"the configs log to different experiments or stores ({listed}); give them one scale, or a ladder of "
            "scales (configs/ladder) that reads one dataset with one tokenizer into one store"
        )
    names = [r.name + ("" if r.cfg.run.arm == "uniform" else f"[{r.cfg.schedule.heads}]") for r in runs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"two configs make the same run ({', '.join(dup)}); list each config once")
    return runs


def ladder_data(cfg) -> tuple[str, ...]:
    """What the scales of a ladder must share (prism scaling compares them): the data order and tokenizer."""
    from pipeline.config.resume_keys import DATA_ORDER_KEYS, flatten

    flat = flatten(cfg.to_dict())
    return tuple(str(flat[k]) for k in (*DATA_ORDER_KEYS, "data.tokenizer"))


def run_study(configs: list[str], seeds: list[int], overrides: list[str], out: str | None = None, jobs: int = 1) -> int:
    """Train every (seed, config) not yet finished, then compare; `prism train`s inherit the console setup.

    ``jobs`` > 1 runs that many at once (each one's console in <output_dir>/logs/<run name>.log): faster on a
    machine with spare cores, and the comparison then notes that their tokens/s shared the machine."""
    from pipeline.compare import compare_arms, compare_scales
    from pipeline.tracking.store import run_uri

    if jobs < 1:
        raise ConfigError(f"--jobs {jobs} must be >= 1")
    t0 = time.monotonic()
    runs = study_runs(configs, seeds, overrides)
    cfg = runs[0].cfg
    lengths = sorted({r.cfg.steps(1)["total"] for r in runs})
    steps = str(lengths[0]) if len(lengths) == 1 else f"{lengths[0]}-{lengths[-1]}"
    experiments = list(dict.fromkeys(r.cfg.experiment for r in runs))  # a ladder: one per scale
    how = "one after another" if jobs == 1 else f"{jobs} at a time"
    print(
        f"prism study: {len(configs)} configs x {len(seeds)} seeds = {len(runs)} runs of {steps} steps x "
        f"{cfg.train.batch_tokens} tokens, {how} -> experiment{'s' if len(experiments) > 1 else ''} "
        f"{', '.join(experiments)}",
        flush=True,
    )
    from data_prep.build import prepare

    for dataset_dir in sorted({r.cfg.data.dataset_dir for r in runs}):  # builds, resumes or reuses it
        prepare(next(r.cfg for r in runs if r.cfg.data.dataset_dir == dataset_dir))
    failed = train_runs(runs, jobs, t0)
    if failed:
        print(f"prism study: {'; '.join(failed)}; rerun the study to resume", flush=True)
        return 1
    uri = run_uri(cfg)
    report_root = Path(out or Path(cfg.run.output_dir) / "compare")
    for experiment in experiments:
        alone = out if len(experiments) == 1 and out else report_root / experiment
        result = compare_arms(experiment, uri, alone)
        print(result["table"])
        for p in result["paths"]:
            print(f"wrote {p}")
    if len(experiments) > 1:  # a ladder: the scaling fits over all of them
        result = compare_scales(experiments, uri, report_root / "scaling")
        print(result["table"])
        for p in result["paths"]:
            print(f"wrote {p}")
    print(f"prism study: done in {duration(time.monotonic() - t0)}", flush=True)
    return 0


def start_run(pool: LocalPool, run: GridRun, head: str, t0: float, failed: list[str]) -> None:
    """Start one run in ``pool``: alone, on this console; beside others, into <output_dir>/logs/<run name>.log.
    Its end is printed, and a failure appended to ``failed`` as the command and its exit code."""
    c, cmd = run.cfg, run.train_command()
    pool.wait_for_slot()
    so_far = duration(time.monotonic() - t0)
    log = None
    if pool.at_once == 1:
        print(f"{head} -> {c.run_dir}  [{so_far} so far]", flush=True)
    else:
        log_path = Path(c.run.output_dir) / "logs" / f"{c.run_name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log = log_path.open("a")
        print(f"{head} -> {c.run_dir}, console in {log_path}  [{so_far} so far]", flush=True)

    def ended(rc: int) -> None:
        if log is not None:
            log.close()
        print(
            f"  {c.run_name}: {'done' if rc == 0 else f'exited with {rc}'}  [{duration(time.monotonic() - t0)} so far]",
            flush=True,
        )
        if rc != 0:
            failed.append(f"`prism {' '.join(cmd[3:])}` exited with {rc}")

    pool.start(cmd, ended, stdout=log)


def train_runs(runs: list[GridRun], jobs: int, t0: float) -> list[str]:
    """Train every run not yet finished, ``jobs`` at a time, stopping at the first failure (the running ones
    finish); returns what failed, each as the command and its exit code."""
    pool, failed = LocalPool(jobs), []
    for i, (run, done) in enumerate(zip(runs, finished_run_ids([r.cfg for r in runs])), start=1):
        head = f"[{i}/{len(runs)}] {run.cfg.run_name} (schedule {run.cfg.schedule.heads})"
        if done:
            print(f"{head}: already finished (MLflow run {done}); skipping", flush=True)
            continue
        start_run(pool, run, head, t0, failed)
        if jobs == 1:  # in turn
            pool.wait()
        if failed:
            break
    pool.wait()
    return failed

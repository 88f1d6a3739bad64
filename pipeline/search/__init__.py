"""`prism search SPEC.yaml`: asynchronous successive halving (ASHA) over schedules, with real `prism train` runs.

Optuna decides: a study in its journal file (``<folder>/optuna-journal.log``, no database server) with
``SuccessiveHalvingPruner`` (or ``HyperbandPruner``) driven through ask/tell. This package is the small driver
around it: it asks for a trial, starts an ordinary `prism train` run for it (the full budget's LR schedule,
so a rung is a prefix of the full run), reads the run's val loss at the rung points (MLflow, else the run's
offline journal), reports it, and stops a pruned run with a stop signal (locally) or ``scancel`` (Slurm): the
run checkpoints and ends as any stopped run does. `prism train` knows nothing about Optuna.

Every launch is written down first (``<folder>/search.json``, replaced atomically: trial -> run folder,
pid or job id), so a driver killed at any point is resumed by ``--resume``: finished trials stay finished,
running ones are found again (their process or job), a trial asked but never started is started once.

The parts, each one decision:
  spec.py       the spec, read and checked field by field; the overrides of every run of the search
  cost.py       the dry run: trials, rungs, tokens against the full grid, GPU hours
  driver.py     the ask/launch/report/prune/tell loop, its record (search.json), the confirmation stage
  report.py     the console summary, the MLflow parent run and its children, the results table and plot
"""

from pipeline.search.cost import dry_run, expected_tokens
from pipeline.search.driver import FINAL, OPTUNA_FILE, STATE_FILE, Driver, make_pruner, make_sampler, run_search
from pipeline.search.spec import Rungs, SearchSpec, load_spec, val_every

__all__ = [
    "FINAL",
    "OPTUNA_FILE",
    "STATE_FILE",
    "Driver",
    "Rungs",
    "SearchSpec",
    "dry_run",
    "expected_tokens",
    "load_spec",
    "make_pruner",
    "make_sampler",
    "run_search",
    "val_every",
]

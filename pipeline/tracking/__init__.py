"""Tracking: the interface the training loop calls, and everything that talks to MLflow behind it.

Global rank 0 gets a real tracker, other ranks a no-op; the loop only calls the Tracker methods and never
imports mlflow. Modules: ``store`` (the tracking-URI rule, the MLflow client, logging to an existing run),
``journal`` (the offline journal, its replay and `prism tracking sync`), ``mlflow_run`` (MlflowTracker:
what a training run logs, milestones, resume into the same run).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Protocol

from pipeline.config import Config


class Tracker(Protocol):
    run_id: str | None

    def start(self, cfg: Config, run_id: str | None = None) -> str | None:
        """Open (or, with run_id, reopen) the run; log params/tags/artifacts on first start."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...

    def log_params(self, params: dict[str, Any]) -> None:
        """Values fixed for a start (e.g. the data budget): params, so they do not crowd the metric charts."""

    def log_artifact_text(self, text: str | bytes, name: str) -> None: ...

    def finish(self, status: str = "FINISHED") -> None: ...


class NullTracker:
    """Non-zero ranks, and tracking.enabled=false."""

    run_id: str | None = None

    def start(self, cfg: Config, run_id: str | None = None) -> str | None:
        self.run_id = run_id
        return run_id

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def log_params(self, params: dict[str, Any]) -> None:
        pass

    def log_artifact_text(self, text: str | bytes, name: str) -> None:
        pass

    def finish(self, status: str = "FINISHED") -> None:
        pass


class JsonlTracker(NullTracker):
    """Append-only metrics file: one JSON object per log call ({"step", "time", **metrics})."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")


def make_tracker(cfg: Config, global_rank: int) -> Any:
    """The tracker for this process: MLflow on rank 0 when enabled, else JSONL (rank 0) or nothing."""
    if global_rank != 0:
        return NullTracker()
    if cfg.tracking.enabled:
        from pipeline.tracking.mlflow_run import MlflowTracker

        return MlflowTracker(cfg)
    return JsonlTracker(cfg.checkpoint_dir / "metrics.jsonl")

"""The tracking interface the training loop calls. Global rank 0 gets a real tracker, others a no-op.

The loop only ever calls these methods; MLflow (pipeline/mlflow_tracking.py) implements them, and the
JSONL file next to the checkpoints is always written so nothing is lost when a server is down.
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

    def log_artifact_text(self, text: str, name: str) -> None: ...

    def finish(self, status: str = "FINISHED") -> None: ...


class NullTracker:
    """Non-zero ranks, and tracking.enabled=false."""

    run_id: str | None = None

    def start(self, cfg: Config, run_id: str | None = None) -> str | None:
        self.run_id = run_id
        return run_id

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def log_artifact_text(self, text: str, name: str) -> None:
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
        from pipeline.mlflow_tracking import MlflowTracker

        return MlflowTracker(cfg)
    return JsonlTracker(cfg.checkpoint_dir / "metrics.jsonl")

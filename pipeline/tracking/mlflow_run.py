"""MlflowTracker: the Tracker for global rank 0, writing every call to the run's journal before sending it.

Training never waits on MLflow for long and never dies of it: a failed delivery leaves the records pending
in the journal (pipeline/tracking/journal.py) and they go out, in order, with the next delivery that
succeeds. Also here: what a training run logs (params, tags, the config and schedule artifacts) and the
val-loss milestones (first step and token count at which val/loss <= x), which survive a resume.
"""

from __future__ import annotations

import atexit
import getpass
import json
import logging
import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from pipeline import schedule
from pipeline.atomic import write_atomic
from pipeline.config import Config, flatten, result_hash
from pipeline.redaction import redact_text, redact_uri
from pipeline.tracking import store
from pipeline.tracking.journal import Delivery, Journal

RETRY_AFTER_S = 60.0  # while offline, try the server again at most this often (keeps steps fast)

log = logging.getLogger("prism.tracking")


# MLflow's UI (3.17, 3.18) shows an experiment in one of two modes, "GenAI" (an empty Overview of traces;
# training runs filed under "Evaluation runs") and "Model training" (the runs list). The mode comes from the
# URL's `workflowType`, else the browser's last choice, default GenAI; the experiment tag
# `mlflow.experimentKind` does not choose it in these versions. So every link we print carries the mode.
UI_MODE = "workflowType=machine_learning"
LOCAL_UI = "http://127.0.0.1:5000"  # where `mlflow ui` serves an SQLite store by default


def ui_page(uri: str, experiment_id: str, run_id: str | None = None) -> str:
    """The UI link of a run (or, without run_id, of the experiment's runs list), in Model-training mode."""
    base = redact_uri(uri).rstrip("/") if uri.startswith(("http://", "https://")) else LOCAL_UI
    page = f"#/experiments/{experiment_id}/runs" + (f"/{run_id}" if run_id else "")
    return f"{base}/{page}?{UI_MODE}"


def milestone_key(threshold: float, what: str) -> str:
    """``milestone/val_4.0_tokens``: the threshold as Python prints the float (4.0, 3.85)."""
    return f"milestone/val_{float(threshold)!r}_{what}"


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, cwd=Path(__file__).resolve().parent
        )
        return out.stdout.strip() if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def schedule_table(cfg: Config) -> str:
    """Per-layer Markdown table (layer, heads, head dim, stage) logged as an artifact."""
    heads = cfg.heads_per_layer
    stage_of = {i: n for n, (_, a, b) in enumerate(schedule.stages(heads), 1) for i in range(a, b)}
    rows = ["| layer | heads | head dim | stage |", "|---|---|---|---|"]
    rows += [f"| {i + 1} | {h} | {cfg.model.d_model // h} | {stage_of[i]} |" for i, h in enumerate(heads)]
    return (
        f"Schedule `{schedule.compact(heads)}` ({cfg.run.arm}, d_model {cfg.model.d_model})\n\n"
        + "\n".join(rows)
        + "\n"
    )


def run_tags(cfg: Config) -> dict[str, str]:
    tags = {
        "kind": "train",
        "arm": cfg.run.arm,
        "scale": cfg.run.scale,
        "schedule": schedule.compact(cfg.heads_per_layer),
        "seed": str(cfg.run.seed),
        "git_commit": git_commit(),
        "config_hash": cfg.hash(),
        "result_hash": result_hash(cfg),  # what "already finished" compares (pipeline.runs.plan)
        "hostname": socket.gethostname(),
        # MLflow's own tags: the UI's "Source", "Version" and "Created by" columns read these.
        "mlflow.source.type": "JOB" if os.environ.get("SLURM_JOB_ID") else "LOCAL",
        "mlflow.source.name": f"prism train {cfg.source}",
        "mlflow.source.git.commit": git_commit(),
        "mlflow.user": _user(),
        "mlflow.note.content": f"{cfg.run.arm} arm, schedule {schedule.compact(cfg.heads_per_layer)}, "
        f"seed {cfg.run.seed}, config {cfg.source}",
    }
    tags.update(branch_tags(cfg))
    if os.environ.get("SLURM_JOB_ID"):
        tags["slurm_job_id"] = os.environ["SLURM_JOB_ID"]
        if os.environ.get("SLURM_ARRAY_JOB_ID"):
            tags["slurm_array"] = f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ.get('SLURM_ARRAY_TASK_ID', '')}"
        if os.environ.get("PRISM_EXCLUDED_NODES"):  # nodes kept off this job after a failed pre-flight
            tags["slurm_excluded_nodes"] = os.environ["PRISM_EXCLUDED_NODES"]
    return tags


def branch_tags(cfg: Config) -> dict[str, str]:
    """A cooldown branch's lineage (pipeline.cooldown), which `prism compare` and `prism scaling` read it as an
    annealed point by: its main run's MLflow run (from the journal beside the main run's checkpoints), the
    branch step and the tokens trained there. None for a main run."""
    if not cfg.is_branch:
        return {}
    from pipeline.checkpoint import checkpoint_folder
    from pipeline.config import ConfigError
    from pipeline.tracking.journal import journal_run_id

    try:
        parent = journal_run_id(checkpoint_folder(cfg.main_run_dir))
    except ConfigError:  # the main run's checkpoints were deleted since: the tags were set at the first start
        parent = None
    step = cfg.cooldown.from_step
    return {
        "branch_parent_run_id": parent or "",
        "branch_step": str(step),
        "branch_tokens": str(step * cfg.train.batch_tokens),
    }


class MlflowTracker:
    """The Tracker protocol on MLflow, for global rank 0."""

    def __init__(self, cfg: Config, journal_dir: str | Path | None = None):
        self.cfg = cfg
        self.uri = store.run_uri(cfg)
        self.journal = Journal(journal_dir or cfg.checkpoint_dir)
        self.run_id: str | None = None
        self.online = True
        self.next_try = 0.0
        self.retry_after_s = RETRY_AFTER_S
        self.monitor: Any = None
        self.milestones = sorted({float(x) for x in cfg.tracking.milestones}, reverse=True)
        self.reached: dict[float, dict[str, int]] = {}
        self.tokens_seen = 0
        self.delivery = Delivery(self.uri, cfg.experiment, self.journal)
        self.finished = True  # until start(); an exit between start() and finish() is a crash

    # --- the interface ---------------------------------------------------------------------------
    def start(self, cfg: Config, run_id: str | None = None) -> str | None:
        self.cfg = cfg
        if self.finished:
            self.finished = False
            atexit.register(self._failed_if_unfinished)
        state = self.journal.state()
        if run_id is not None and state["run_id"] not in (None, run_id):
            # The checkpoint is the source of truth (e.g. a journal copied from another run).
            log.warning(
                "tracking: checkpoint run id %s differs from journal's %s; using the checkpoint's",
                run_id,
                state["run_id"],
            )
        if os.environ.get("SLURM_JOB_ID") and (secret := store.secret_env_name()):
            log.warning(
                "tracking: %s is in this Slurm job's environment, which Slurm may store (AccountingStoreFlags="
                "job_env); %s",
                secret,
                store.CREDENTIALS_ADVICE,
            )
        shown_uri = redact_uri(self.uri)  # the state file never holds a password; sync takes it from the env
        if run_id is not None:
            self.journal.save_state(run_id=run_id, uri=shown_uri, experiment=cfg.experiment)
        else:
            self.journal.save_state(uri=shown_uri, experiment=cfg.experiment)
        self._restore_milestones()
        params = {k: _param_value(v) for k, v in flatten(cfg.to_dict()).items()}
        params["tracking.uri"] = _param_value(redact_uri(cfg.tracking.uri))
        self.journal.append(
            {"op": "start", "time": _now_ms(), "run_name": cfg.run_name, "tags": run_tags(cfg), "params": params}
        )
        self._deliver(force=True)
        self.run_id = self.journal.state()["run_id"]  # None while the store is unreachable
        # Re-logged on resume too: the artifact then shows the config the run finished with.
        self.log_artifact_text(cfg.dump(), "config.yaml")
        self.log_artifact_text(schedule_table(cfg), "schedule.md")
        self._start_system_metrics()
        return self.run_id

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        metrics = {k: float(v) for k, v in metrics.items() if v is not None}
        if "train/tokens_seen" in metrics:
            self.tokens_seen = int(metrics["train/tokens_seen"])
        if "val/loss" in metrics:
            self._new_milestones(metrics["val/loss"], step)
        self.journal.append({"op": "metrics", "time": _now_ms(), "step": int(step), "metrics": metrics})
        self._deliver()
        if self.online and self.run_id is not None and self.monitor is None:
            self._start_system_metrics()  # the run was created only now (the server was down at start)

    def log_params(self, params: dict[str, Any]) -> None:
        """Params beyond the config (the data budget of this start); a resume that logs another value keeps the
        first one (MLflow params are immutable) and names the key in the run's `params_changed_on_resume` tag."""
        self.journal.append(
            {"op": "params", "time": _now_ms(), "params": {k: _param_value(v) for k, v in params.items()}}
        )
        self._deliver()

    def log_artifact_text(self, text: str | bytes, name: str) -> None:
        # The text is kept beside the journal so a replay can still upload it.
        rel = Path("tracking-artifacts") / f"{len(self.journal.records()):06d}" / Path(name).name
        dest = self.journal.folder / rel
        write_atomic(dest, text)
        folder = str(Path(name).parent) if Path(name).parent != Path(".") else ""
        self.journal.append({"op": "artifact", "time": _now_ms(), "file": str(rel), "dir": folder})
        self._deliver()

    def finish(self, status: str = "FINISHED") -> None:
        self.finished = True
        atexit.unregister(self._failed_if_unfinished)
        if self.milestones:
            missed = [x for x in self.milestones if x not in self.reached]
            tags = {f"milestone.val_{x!r}": "not reached" for x in missed}
            tags["milestones_not_reached"] = ",".join(repr(x) for x in missed) or "none"
            self.journal.append({"op": "tags", "time": _now_ms(), "tags": tags})
        if self.monitor is not None:
            self.monitor.finish()
            self.monitor = None
        self.journal.append({"op": "finish", "time": _now_ms(), "status": status})
        self._deliver(force=True)
        if self.journal.pending():
            log.warning(
                "tracking: %d records not delivered to %s; run `prism tracking sync %s` later",
                len(self.journal.pending()),
                redact_uri(self.uri),
                self.journal.folder,
            )

    def ui_links(self) -> tuple[str, str] | None:
        """(this run's page, its experiment's runs list) in the MLflow UI (password masked), or None before
        the run exists. For an SQLite store the links assume `mlflow ui` on its default address."""
        run_id = self.journal.state().get("run_id")
        if run_id is None:
            return None
        try:
            exp_id = self.delivery.experiment_id()
        except Exception:  # noqa: BLE001 - the store went away since start(); the URL is a nicety
            return None
        return ui_page(self.uri, exp_id, run_id), ui_page(self.uri, exp_id)

    def ui_url(self) -> str | None:
        """What `prism train` prints after "MLflow run ": the run's link, and on an indented second line the
        experiment's runs list (and, for an SQLite store, the command that serves both)."""
        links = self.ui_links()
        if links is None:
            return None
        run, runs = links
        text = f"{run}\n  all runs of {self.cfg.experiment}: {runs}"
        if self.uri.startswith(("http://", "https://")):
            return text
        return f"{text} (after: mlflow ui --backend-store-uri {redact_uri(self.uri)})"

    # --- helpers ---------------------------------------------------------------------------------
    def _failed_if_unfinished(self) -> None:
        """At interpreter exit: a run that started and never finished crashed (an exception escaped the
        loop); mark it FAILED in the journal and the store rather than leave it RUNNING for ever."""
        if not self.finished:
            log.warning("tracking: the run ended without finishing; marking it FAILED")
            self.finish("FAILED")

    def _deliver(self, force: bool = False) -> None:
        if not self.online and not force and time.monotonic() < self.next_try:
            return
        try:
            self.delivery.flush()
        except Exception as e:  # noqa: BLE001 - any failure to deliver: keep training, keep the journal
            if self.online:
                log.warning(
                    "tracking: MLflow at %s unavailable (%s); buffering in %s",
                    redact_uri(self.uri),
                    redact_text(str(e).splitlines()[0])[:200],
                    self.journal.path,
                )
            self.online = False
            self.next_try = time.monotonic() + self.retry_after_s
            return
        if not self.online:
            log.warning("tracking: MLflow at %s is back; replayed the buffered records", redact_uri(self.uri))
            self.online = True
            if self.run_id is None:  # the run was created only now
                self.run_id = self.journal.state()["run_id"]

    def _start_system_metrics(self) -> None:
        """This node's system metrics (pipeline.tracking.system: restarted there when MLflow's thread quits)."""
        if not self.cfg.tracking.system_metrics or self.run_id is None:
            return
        from pipeline.distributed import node_name
        from pipeline.tracking.system import NodeMetrics

        self.monitor = NodeMetrics(self.run_id, self.uri, node_name()).start()

    def _new_milestones(self, val_loss: float, step: int) -> None:
        """Milestones are tags (one value each, shown in the run's overview), not metrics: as metrics they
        led every chart view with single points."""
        tags: dict[str, str] = {}
        for x in self.milestones:
            if x in self.reached or not val_loss <= x:
                continue
            self.reached[x] = {"step": step, "tokens": self.tokens_seen}
            tags[milestone_key(x, "tokens")] = str(self.tokens_seen)
            tags[milestone_key(x, "step")] = str(step)
            tags[f"milestone.val_{x!r}"] = f"reached at step {step}, {self.tokens_seen} tokens"
        if tags:
            self.journal.append({"op": "tags", "time": _now_ms(), "tags": tags})

    def _restore_milestones(self) -> None:
        """After a resume, milestones already logged by this run stay reached (they were first)."""
        for rec in self.journal.records():
            if rec["op"] != "tags":
                continue
            m = rec["tags"]
            for x in self.milestones:
                if x not in self.reached and milestone_key(x, "step") in m:
                    self.reached[x] = {
                        "step": int(m[milestone_key(x, "step")]),
                        "tokens": int(m[milestone_key(x, "tokens")]),
                    }


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (some containers)
        return os.environ.get("USER", "unknown")


def _param_value(v: Any) -> str:
    text = json.dumps(v) if isinstance(v, list | dict) else str(v)
    return text[:6000]  # MLflow's param value limit


def _now_ms() -> int:
    return int(time.time() * 1000)

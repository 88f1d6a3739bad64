"""System metrics of one node into the run: MLflow's own monitor, with the node's name in every key.

Each node's first rank runs one (global rank 0 through its MlflowTracker, the others from the trainer), so
a multi-node run has system/<node>/cpu_utilization_percentage, .../system_memory_usage_megabytes, disk and
network for every node, and on GPU nodes MLflow's GPU series (system/<node>/gpu_0_utilization_percentage,
gpu_0_memory_usage_megabytes, gpu_0_power_usage_watts, ...) through pynvml (the `gpu` extra, which
`make setup` installs where nvidia-smi is found); without it MLflow leaves the GPU series out and nothing
else changes.

Training never waits for it: the monitor is built (one request to the server) and restarted, when its thread
quits on a failed request, by a daemon thread of its own, at most once per RETRY_AFTER_S.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Any

from pipeline.redaction import redact_text

RETRY_AFTER_S = 60.0
log = logging.getLogger("prism.tracking")


def metric_node_id(node: str) -> str:
    """A node name as MLflow accepts it inside a metric key (letters, digits, _ - . and space)."""
    return re.sub(r"[^A-Za-z0-9_.\- ]", "_", node) or "node"


class NodeMetrics:
    """MLflow's SystemMetricsMonitor for ``run_id`` under ``system/<node>/``, kept alive off the training thread."""

    def __init__(self, run_id: str, uri: str, node: str, retry_after_s: float = RETRY_AFTER_S) -> None:
        self.run_id, self.uri, self.node_id = run_id, uri, metric_node_id(node)
        self.retry_after_s = retry_after_s
        self.monitor: Any = None
        self._stop = threading.Event()
        self._lock = threading.Lock()  # a monitor is started only while finish() has not run
        self._thread = threading.Thread(target=self._keep, daemon=True, name=f"prism-system-metrics-{self.node_id}")
        self._warned = False

    def start(self) -> NodeMetrics:
        self._thread.start()
        return self

    def _keep(self) -> None:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        while not self._stop.is_set():
            try:
                monitor = SystemMetricsMonitor(
                    self.run_id, resume_logging=True, node_id=self.node_id, tracking_uri=self.uri
                )
                with self._lock:
                    # finish() may have run while the monitor was being built: never start one after it
                    if self._stop.is_set():
                        return
                    self.monitor = monitor
                    monitor.start()
                # the monitor's thread ends when a request fails or the run is no longer RUNNING
                while not self._stop.wait(1.0) and self._alive():
                    pass
            except Exception as e:  # noqa: BLE001 - system metrics are a nicety; never stop training for them
                if not self._warned:
                    log.warning("tracking: system metrics of %s paused (%s)", self.node_id, redact_text(str(e))[:200])
                    self._warned = True
            self._stop.wait(self.retry_after_s)

    def _alive(self) -> bool:
        thread = getattr(self.monitor, "_process", None)  # MLflow's monitor thread (None: it did not start)
        return thread is not None and thread.is_alive()

    def finish(self, wait_s: float = 10.0) -> None:
        """Stop; MLflow's own finish (its last samples) gets ``wait_s``: with the server down its requests
        retry for minutes, and the exit must not wait for them."""
        with self._lock:
            self._stop.set()
            monitor = self.monitor
        if monitor is not None:
            closing = threading.Thread(target=self._finish_quietly, args=(monitor,), daemon=True)
            closing.start()
            closing.join(wait_s)

    @staticmethod
    def _finish_quietly(monitor: Any) -> None:
        try:
            monitor.finish()
        except Exception:  # noqa: BLE001 - at the end of training; nothing left to protect but the exit
            pass


def other_node_metrics(cfg: Any, run_id: str | None, ranks: list[dict[str, Any]], rank: int) -> NodeMetrics | None:
    """Started on the first rank of every node but global rank 0's (whose MlflowTracker reports its node);
    ``ranks``: pipeline.distributed.topology(). None elsewhere, without tracking, or before the run exists."""
    from pipeline.tracking import store

    node = ranks[rank]["node"]
    first = next(r["rank"] for r in ranks if r["node"] == node)
    if rank != first or node == ranks[0]["node"] or run_id is None:
        return None
    if not (cfg.tracking.enabled and cfg.tracking.system_metrics):
        return None
    return NodeMetrics(run_id, store.run_uri(cfg), node).start()

"""The terminal is for prism's own lines; library noise goes to a log file. `--verbose` turns this off.
Also here: the one duration format, and the trainer's rate and ETA (Progress).

Noise handled here: Python warnings (megatron-core's "Transformer Engine and Apex are not installed" at
import), MLflow's INFO lines (store creation, system-metrics monitor) and datatrove's per-task logs and stats
blocks (loguru on stderr, also from its worker processes). Errors stay on the terminal: warnings and
MLflow WARNING/ERROR lines are not dropped, only moved, and prism's own errors print as before.

The log file is <run.output_dir>/logs/prism-<verb>.log (run.output_dir as given on the command line, else
runs); processes a verb starts (the demo's and the study's `prism train`) inherit it through PRISM_LOG_FILE
and append to it, and inherit --verbose through PRISM_VERBOSE=1.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

LOG_ENV = "PRISM_LOG_FILE"
VERBOSE_ENV = "PRISM_VERBOSE"


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV) == "1"


def log_file() -> Path | None:
    """Where library output goes now; None when it stays on the terminal (--verbose)."""
    path = os.environ.get(LOG_ENV)
    return None if verbose() or not path else Path(path)


def default_log_path(verb: str, argv: list[str]) -> Path:
    out = next((a.split("=", 1)[1] for a in argv if a.startswith("run.output_dir=")), "") or "runs"
    return Path(out) / "logs" / f"prism-{verb}.log"


@contextlib.contextmanager
def routed(verb: str, argv: list[str], want_verbose: bool) -> Iterator[Path | None]:
    """`setup` for the length of one CLI call, then the environment and logging as they were (tests call
    `main` many times in one process)."""
    keys = (LOG_ENV, VERBOSE_ENV, "MLFLOW_LOGGING_LEVEL")
    saved_env = {k: os.environ.get(k) for k in keys}
    warned = logging.getLogger("py.warnings")
    saved_log = (warned.handlers[:], warned.propagate)
    try:
        yield setup(verb, argv, want_verbose)
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for h in warned.handlers:
            if h not in saved_log[0]:
                h.close()
        warned.handlers, warned.propagate = saved_log
        logging.captureWarnings(False)


def setup(verb: str, argv: list[str], want_verbose: bool) -> Path | None:
    """Route library output for this process (call before torch/megatron/mlflow are imported)."""
    if want_verbose or verbose():
        os.environ[VERBOSE_ENV] = "1"
        return None
    path = Path(os.environ.get(LOG_ENV) or default_log_path(verb, argv)).absolute()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(path, encoding="utf-8")
    except OSError:  # an unwritable output folder is reported by the verb itself, with its fix
        return None
    os.environ[LOG_ENV] = str(path)
    # MLflow reads this when it is imported: its INFO chatter is off the terminal, its warnings stay.
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
    logging.captureWarnings(True)
    warned = logging.getLogger("py.warnings")
    warned.handlers = [handler]
    warned.propagate = False
    return path


@contextlib.contextmanager
def library_output_to_log() -> Iterator[Path | None]:
    """Send everything written to stderr (fd 2: this process, its threads and the processes it starts)
    to the log file while the block runs; yields the file (None under --verbose)."""
    path = log_file()
    if path is None:
        yield None
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "a", encoding="utf-8") as f:
        os.dup2(f.fileno(), 2)
        try:
            yield path
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


def duration(seconds: float) -> str:
    """12 s, 4 min 05 s, 2 h 03 min."""
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


# --- the trainer's step line: rate and ETA -----------------------------------------------------------------
@dataclass
class Pace:
    train_tokens_per_sec: float  # since the last line, training only: validation and checkpoint time left out
    elapsed: float  # seconds since training started in this process
    eta: float  # remaining steps at the training rate + the validations and checkpoints still to come


class Progress:
    """What the step line says about speed. Training time is what the loop measured for its steps and hands
    over with ``trained(seconds)``: the one clock perf/step_time is read from, so the line's train tok/s and
    the logged perf/train_tokens_per_sec agree and a validation step does not look slow. The ETA adds the validations,
    evals and checkpoints still to come at their measured mean cost (``with progress.aside("validation")``,
    ``"eval"``, ``"checkpoint"``; a validation or eval not yet measured: a forward pass over its tokens, a
    third of a training step per token). ``checkpoint_steps`` may be a function of the measured seconds per
    step (saves by the clock, checkpoint.every_minutes: pipeline.cadence.checkpoint_steps). ``clock`` (elapsed time and the aside timings) is injectable so the
    rule can be tested with a fake one."""

    def __init__(
        self,
        total_steps: int,
        step: int,
        tokens_per_step: int,
        validation_steps: Sequence[int],
        checkpoint_steps: Sequence[int] | Callable[[float], Sequence[int]],
        validation_tokens: int,
        eval_steps: Sequence[int] = (),
        eval_tokens: int = 0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.total_steps, self.tokens_per_step = total_steps, tokens_per_step
        self.forward_tokens = {"validation": validation_tokens, "eval": eval_tokens}
        self.upcoming = {
            "validation": sorted(validation_steps),
            "eval": sorted(eval_steps),
            "checkpoint": [] if callable(checkpoint_steps) else sorted(checkpoint_steps),
        }
        # the steps that checkpoint at a pace (seconds a training step takes): saves by the clock depend on it
        self.checkpoints_at = checkpoint_steps if callable(checkpoint_steps) else None
        self.spent = {"validation": [0.0, 0], "eval": [0.0, 0], "checkpoint": [0.0, 0]}  # seconds, count
        self.clock = clock
        self.started = clock()
        self.last_step, self.trained_since_line = step, 0.0

    def trained(self, seconds: float) -> None:
        """``seconds`` of training (steps only) since the last call."""
        self.trained_since_line += seconds

    @contextlib.contextmanager
    def aside(self, kind: str) -> Iterator[None]:
        """Time the block as ``kind`` (validation, eval or checkpoint), not as training."""
        t0 = self.clock()
        try:
            yield
        finally:
            self.spent[kind][0] += self.clock() - t0
            self.spent[kind][1] += 1

    def pace(self, step: int) -> Pace | None:
        """The rate and ETA for the line at ``step`` (after its validation, before its eval and checkpoint);
        None when no step was trained since the last line."""
        steps, seconds = step - self.last_step, self.trained_since_line
        self.last_step, self.trained_since_line = step, 0.0
        if steps <= 0 or seconds <= 0:
            return None
        per_step = seconds / steps
        if self.checkpoints_at is not None:
            self.upcoming["checkpoint"] = sorted(self.checkpoints_at(per_step))
        forward = {k: self._mean(k, per_step * n / self.tokens_per_step / 3) for k, n in self.forward_tokens.items()}
        eta = (
            (self.total_steps - step) * per_step
            + forward["validation"] * sum(s > step for s in self.upcoming["validation"])  # this step's is done
            + forward["eval"] * sum(s >= step for s in self.upcoming["eval"])  # its is not
            + self._mean("checkpoint", 0.0) * sum(s >= step for s in self.upcoming["checkpoint"])
        )
        return Pace(steps * self.tokens_per_step / seconds, self.clock() - self.started, eta)

    def _mean(self, kind: str, unmeasured: float) -> float:
        seconds, count = self.spent[kind]
        return seconds / count if count else unmeasured

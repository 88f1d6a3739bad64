"""The whole study in miniature, offline, on CPU (what `prism demo` and `make demo` run).

Embedded corpus + BPE tokenizer -> `prism prepare` -> `prism train` for tiny_uniform and tiny_prism (same data,
seed and token budget; each arm a clean subprocess through the real DeepSpeed path, zero-shot evals at three
steps) -> both logged to one SQLite MLflow store (<run.output_dir>/mlflow.db) -> `prism compare` table and plots
(val loss and downstream accuracy against tokens), next to the unigram
entropy of the training tokens (a model that learned nothing beyond token frequencies scores about that).
A second run reuses the dataset and skips arms whose MLflow run already FINISHED with the same result_hash (config.result_hash).
"""

from __future__ import annotations

import math
import re
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from pipeline.console import duration

ARMS = ("uniform", "prism")
# What the demo adds to the tiny presets (before the user's overrides): zero-shot evals at steps 128, 256 and 384,
# on the preset's eval_tasks and small eval_limit (the presets leave them off for the tests' short runs).
DEMO_OVERRIDES = ("train.eval_every=128",)
# Keys both arms must share for the comparison to mean anything (the schedule is what differs).
SHARED_KEYS = ("run.seed", "train", "data", "model.seq_len", "model.num_layers", "model.d_model")


def unigram_entropy(manifest_path: Path) -> tuple[float, float, int]:
    """(entropy of the train split's token frequencies, cross-entropy of that unigram on val, train tokens).

    Both in nats per token, like the loss. The val figure uses add-one smoothing so unseen tokens count.
    """
    import numpy as np

    from pipeline import dataset

    root = Path(manifest_path).parent
    manifest = dataset.read_manifest(root)
    vocab = manifest["tokenizer"]["vocab_size"]

    def counts(split: str) -> np.ndarray:
        total = np.zeros(vocab, dtype=np.int64)
        for shard in dataset.iter_shards(root, split, manifest):
            predicted = shard[..., 1:].ravel().astype(np.int64)  # the tokens a model is scored on
            total += np.bincount(predicted, minlength=vocab)[:vocab]
        return total

    train, val = counts("train"), counts("val")
    p = train[train > 0] / train.sum()
    entropy = float(-(p * np.log(p)).sum())
    smoothed = (train + 1) / (train.sum() + vocab)
    cross = float(-(val * np.log(smoothed)).sum() / max(1, val.sum()))
    return entropy, cross, int(train.sum())


def find_presets(preset_dir: str | Path | None = None) -> Path:
    """The folder with tiny_{uniform,prism}.yaml: the one given, else ./configs, else the project's configs/
    (a checkout or an editable install), so `prism demo` runs from any directory."""
    from pipeline.config import PROJECT_CONFIGS, ConfigError, preset_name

    if preset_dir is not None:
        return Path(preset_dir)
    for folder in (Path("configs"), PROJECT_CONFIGS):
        if all((folder / preset_name(arm, "tiny")).is_file() for arm in ARMS):
            return folder
    raise ConfigError("no tiny_uniform.yaml / tiny_prism.yaml in ./configs or beside the package; pass --preset-dir")


def run_demo(overrides: list[str], preset_dir: str | Path | None = None) -> int:
    """Prepare, train both tiny arms, compare; returns the exit code (an arm's own when its training failed)."""
    from pipeline.runs.plan import finished_run_ids
    from pipeline.tracking.store import run_uri

    t0 = time.monotonic()
    runs = demo_runs(overrides, preset_dir)
    cfgs = {arm: run.cfg for arm, run in runs.items()}
    cfg = cfgs["prism"]
    steps = cfg.steps(1)["total"]
    say(
        f"prism demo: the Prism study in miniature on CPU: {steps} steps x {cfg.train.batch_tokens} tokens per arm "
        f"= {steps * cfg.train.batch_tokens:,} tokens, {len(ARMS)} arms ({', '.join(ARMS)}), "
        f"d_model {cfg.model.d_model}, {cfg.model.num_layers} layers, {arms_at_once()} arm(s) at a time on "
        f"{THREADS_PER_ARM} thread each; an estimate follows once the arms have timed their first steps. "
        f"Reruns reuse the data and finished runs."
    )
    from pipeline.console import log_file

    if log_file():
        say(f"  library output (warnings, MLflow, datatrove) -> {log_file()}; `prism demo --verbose` shows it here")

    say("[1/4] data: embedded corpus + BPE tokenizer + prism prepare")
    from data_prep.build import prepare

    manifest = prepare(cfg)

    todo: dict[str, list[str]] = {}
    for i, (arm, done) in enumerate(zip(ARMS, finished_run_ids(list(cfgs.values()))), start=2):
        c = cfgs[arm]
        if done:
            say(f"[{i}/4] train {c.run_name}: already finished (MLflow run {done}); skipping")
            continue
        so_far = duration(time.monotonic() - t0)
        say(f"[{i}/4] train {c.run_name} (schedule {c.schedule.heads}) -> {c.run_dir}  [{so_far} so far]")
        todo[arm] = runs[arm].train_command()
    rc = train_arms(todo, cfg, t0)
    if rc != 0:
        return rc

    say(f"[4/4] compare  [{duration(time.monotonic() - t0)} so far]")
    from pipeline.compare import compare_arms

    uri = run_uri(cfg)
    result = compare_arms(cfg.experiment, uri, Path(cfg.run.output_dir) / "compare" / cfg.experiment)
    print(result["table"])
    for p in result["paths"]:
        print(f"  {p}")
    print_baselines(result, Path(manifest))
    print(
        f"\nMLflow UI: .venv/bin/mlflow ui --backend-store-uri {uri}  -> experiment {cfg.experiment}, "
        f"tick both runs, Compare."
    )
    from pipeline.export.generate import demo_continuations

    print(f"\n{demo_continuations({arm: cfgs[arm].checkpoint_dir for arm in ARMS})}")
    say(f"prism demo: done in {duration(time.monotonic() - t0)}")
    return 0


def demo_runs(overrides: list[str], preset_dir: str | Path | None = None) -> dict[str, Any]:
    """Each arm's GridRun from the tiny presets, the demo's overrides and the user's; the arms must share
    data, seed and budget (SHARED_KEYS) or the comparison would mean nothing."""
    from pipeline.config import ConfigError, changed_keys, preset_name
    from pipeline.runs.plan import expand_grid

    folder = find_presets(preset_dir)
    presets = [folder / preset_name(arm, "tiny") for arm in ARMS]
    runs = dict(zip(ARMS, expand_grid(presets, overrides=[*DEMO_OVERRIDES, *overrides])))
    differ = changed_keys(runs["uniform"].cfg.to_dict(), runs["prism"].cfg.to_dict(), SHARED_KEYS)
    if differ:
        raise ConfigError(f"the demo arms must share data, seed and budget; they differ in {', '.join(differ)}")
    return runs


def print_baselines(result: dict[str, Any], manifest: Path) -> None:
    """Each arm's final val loss against the unigram model of the training tokens (what a model that learned
    nothing beyond token frequencies scores)."""
    entropy, cross, tokens = unigram_entropy(manifest)
    finals = {r["arm"]: r["final_val_loss_mean"] for r in result["rows"]}
    print(
        f"\nUnigram entropy of the {tokens:,} training tokens: {entropy:.3f} nats "
        f"(that unigram's cross-entropy on val: {cross:.3f})."
    )
    for arm in ARMS:
        gap = finals[arm] - cross
        where = "below" if gap < 0 else "ABOVE"
        print(f"  final val loss {arm:>7}: {finals[arm]:.3f}  ({abs(gap):.3f} nats {where} the unigram baseline)")
    if not all(finals[a] < cross for a in ARMS if not math.isnan(finals[a])):
        print("  note: a val loss is not below the unigram baseline: the budget is too small to learn context")


# Each arm trains on one thread, alone or beside the other: fp32 results on CPU depend on the thread count
# (a tiny arm on 1 and on 2 threads differs from its second step on, by ~1e-7), so a fixed count keeps an
# arm's losses the same whether the arms run together or in turn. On 2 cores, two 1-thread arms side by side
# finish sooner than two 2-thread arms one after the other (the README gives the measured ratio).
THREADS_PER_ARM = 1
STEP_LINE = re.compile(r"^step\s+(\d+)/(\d+) ")  # `prism train`'s step lines: "step     10/384 | ..."


def arms_at_once() -> int:
    """How many arms train side by side: as many as the cores hold at THREADS_PER_ARM each."""
    from pipeline.distributed import node_cpus

    return max(1, min(len(ARMS), node_cpus() // THREADS_PER_ARM))


def train_arms(commands: dict[str, list[str]], cfg, t0: float) -> int:
    """Run each arm's `prism train` (arms_at_once() at a time, one thread each), relaying its lines prefixed
    with the arm; print one estimate when every running arm has timed its first logged steps. Returns 0, or
    the exit code of the first arm that failed (the others still finish)."""
    from pipeline.runs.launch import LocalPool

    pool = LocalPool(arms_at_once(), threads=THREADS_PER_ARM)
    timing = ArmTiming(cfg, t0, len(commands), pool.at_once)
    failed: list[int] = []
    for arm, cmd in commands.items():
        pool.wait_for_slot()
        timing.started(arm)
        relay = threading.Thread(target=timing.relay, args=(arm,), daemon=True)

        def ended(rc: int, arm: str = arm, relay: threading.Thread = relay) -> None:
            relay.join()
            if rc != 0:
                say(f"prism demo: `{' '.join(commands[arm][2:])}` exited with {rc}; rerun `make demo` to resume it")
                failed.append(rc)

        timing.procs[arm] = pool.start(cmd, ended, stdout=subprocess.PIPE)
        relay.start()
    pool.wait()
    return failed[0] if failed else 0


class ArmTiming:
    """Times each arm from its step lines and prints the demo's estimate once, from what it measured:
    per arm the seconds per step between its first two step lines, plus the validations and evals still ahead
    (a forward pass costs about a third of a training step per token), plus start-up for arms not begun."""

    def __init__(self, cfg, t0: float, arms: int, at_once: int):
        self.cfg, self.t0, self.arms, self.at_once = cfg, t0, arms, at_once
        self.lock = threading.Lock()
        self.launched: dict[str, float] = {}
        self.procs: dict[str, subprocess.Popen] = {}
        self.points: dict[str, list[tuple[float, int, int]]] = {}  # arm -> [(time, step, total)] of 2 lines
        self.said = False

    def started(self, arm: str) -> None:
        with self.lock:
            self.launched[arm] = time.monotonic()

    def relay(self, arm: str) -> None:
        for line in self.procs[arm].stdout:
            match = STEP_LINE.match(line)
            if match:
                self.step(arm, int(match.group(1)), int(match.group(2)))
            print(f"{arm:>7} | {line}", end="", flush=True)

    def step(self, arm: str, step: int, total: int) -> None:
        with self.lock:
            points = self.points.setdefault(arm, [])
            if len(points) < 2:
                points.append((time.monotonic(), step, total))
            timed = [a for a in self.points if len(self.points[a]) == 2]
            if self.said or len(timed) < min(self.at_once, self.arms):
                return
            self.said = True
            seconds = self.remaining_seconds(timed)
        say(
            f"prism demo: estimate from the first steps: training done in about {duration(seconds)}, the demo "
            f"in about {duration(time.monotonic() - self.t0 + seconds)} in all"
        )

    def remaining_seconds(self, timed: list[str]) -> float:
        from pipeline.eval.plan import aside_cost

        left, whole = [], []
        for arm in timed:
            (t1, s1, total), (t2, s2, _) = self.points[arm]
            aside = aside_cost(self.cfg, total)["share"]  # validations and evals: their share of the arm's time
            per_step = (t2 - t1) / max(1, s2 - s1) / (1 - aside)
            left.append((total - s2) * per_step)
            whole.append(t1 - self.launched[arm] + total * per_step)  # start-up + all steps
        rounds_after = math.ceil((self.arms - len(timed)) / self.at_once)  # arms still waiting for a core
        return max(left) + rounds_after * max(whole)


def say(text: str) -> None:
    print(text, flush=True)

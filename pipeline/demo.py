"""The whole study in miniature, offline, on CPU (what `prism demo` and `make demo` run).

Embedded corpus + BPE tokenizer -> `prism prepare` -> `prism train` for tiny_uniform and tiny_prism (same data,
seed and token budget; each arm a clean subprocess through the real DeepSpeed path) -> both logged to one
SQLite MLflow store (<run.output_dir>/mlflow.db) -> `prism compare` table and plots, next to the unigram
entropy of the training tokens (a model that learned nothing beyond token frequencies scores about that).
A second run reuses the dataset and skips arms whose MLflow run already FINISHED with the same config.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

ARMS = ("uniform", "prism")
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


def finished_run(cfg) -> str | None:
    """Run id of an already FINISHED MLflow run of exactly this config, if the store has one."""
    from pipeline.tracking import store

    uri = store.run_uri(cfg)
    if not store.store_exists(uri):
        return None
    client = store.client(uri)
    exp = client.get_experiment_by_name(cfg.experiment)
    if exp is None:
        return None
    found = client.search_runs(
        [exp.experiment_id],
        filter_string=f"attributes.run_name = '{cfg.run_name}' and attributes.status = "
        f"'FINISHED' and tags.config_hash = '{cfg.hash()}'",
        max_results=1,
    )
    return found[0].info.run_id if found else None


def find_presets(preset_dir: str | Path | None = None) -> Path:
    """The folder with tiny_{uniform,prism}.yaml: the one given, else ./configs, else configs/ beside the
    package (a checkout or an editable install), so `prism demo` runs from any directory."""
    if preset_dir is not None:
        return Path(preset_dir)
    for folder in (Path("configs"), Path(__file__).resolve().parents[1] / "configs"):
        if all((folder / f"tiny_{arm}.yaml").is_file() for arm in ARMS):
            return folder
    from pipeline.config import ConfigError

    raise ConfigError("no tiny_uniform.yaml / tiny_prism.yaml in ./configs or beside the package; pass --preset-dir")


def run_demo(overrides: list[str], preset_dir: str | Path | None = None) -> int:
    """Prepare, train both tiny arms, compare; returns the exit code (an arm's own when its training failed)."""
    from pipeline import config
    from pipeline.config import ConfigError, changed_keys
    from pipeline.tracking.store import run_uri

    t0 = time.monotonic()
    presets = {arm: str(find_presets(preset_dir) / f"tiny_{arm}.yaml") for arm in ARMS}
    cfgs = {arm: config.load(path, overrides) for arm, path in presets.items()}
    differ = changed_keys(cfgs["uniform"].to_dict(), cfgs["prism"].to_dict(), SHARED_KEYS)
    if differ:
        raise ConfigError(f"the demo arms must share data, seed and budget; they differ in {', '.join(differ)}")
    cfg = cfgs["prism"]
    steps = cfg.steps(1)["total"]
    say(
        f"prism demo: the Prism study in miniature on CPU: {steps} steps x {cfg.train.batch_tokens} tokens per arm "
        f"= {steps * cfg.train.batch_tokens:,} tokens, {len(ARMS)} arms ({', '.join(ARMS)}), "
        f"d_model {cfg.model.d_model}, {cfg.model.num_layers} layers; about {estimate_minutes(cfg)} min on 2 free "
        f"cores (first run), reruns reuse the data and finished runs."
    )
    from pipeline.console import log_file

    if log_file():
        say(f"  library output (warnings, MLflow, datatrove) -> {log_file()}; `prism demo --verbose` shows it here")

    say("[1/4] data: embedded corpus + BPE tokenizer + prism prepare")
    # data_prep.build directly: an editable install made before data_prep/__init__.py existed sees a
    # namespace package (no `prepare` attribute) when run from outside the repo.
    from data_prep.build import prepare

    manifest = prepare(cfg)

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for i, arm in enumerate(ARMS, start=2):
        c = cfgs[arm]
        done = finished_run(c)
        if done:
            say(f"[{i}/4] train {c.run_name}: already finished (MLflow run {done}); skipping")
            continue
        say(f"[{i}/4] train {c.run_name} (schedule {c.schedule.heads}) -> {c.run_dir}  [{elapsed(t0)} so far]")
        cmd = [sys.executable, "-m", "pipeline.cli", "train", presets[arm], *overrides]
        rc = subprocess.run(cmd, env=env).returncode
        if rc != 0:
            say(f"prism demo: `{' '.join(cmd[2:])}` exited with {rc}; rerun `make demo` to resume it")
            return rc

    say(f"[4/4] compare  [{elapsed(t0)} so far]")
    from pipeline.compare import compare_arms

    uri = run_uri(cfg)
    result = compare_arms(cfg.experiment, uri, Path(cfg.run.output_dir) / "compare" / cfg.experiment)
    print(result["table"])
    for p in result["paths"]:
        print(f"  {p}")
    entropy, cross, tokens = unigram_entropy(Path(manifest))
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
    print(
        f"\nMLflow UI: .venv/bin/mlflow ui --backend-store-uri {uri}  -> experiment {cfg.experiment}, "
        f"tick both runs, Compare."
    )
    from pipeline.export.generate import demo_continuations

    print(f"\n{demo_continuations({arm: cfgs[arm].checkpoint_dir for arm in ARMS})}")
    say(f"prism demo: done in {elapsed(t0)}")
    return 0


# Measured on this 2-core machine with the tiny preset (d 192, 8 layers, seq 256): ~3,300 tokens/s per arm in
# fp32, ~25 s of start-up per `prism train`, ~60 s for corpus + tokenizer + shards on a fresh clone.
TINY_TOKENS_PER_SEC, START_SECONDS, DATA_SECONDS = 3300, 25, 60


def estimate_minutes(cfg) -> int:
    """The budget the banner announces, from the config actually run (not a constant)."""
    per_arm = cfg.steps(1)["total"] * cfg.train.batch_tokens / TINY_TOKENS_PER_SEC + START_SECONDS
    width = (cfg.model.d_model / 192) ** 2 * cfg.model.num_layers / 8  # cost grows ~ layers x width^2
    return max(1, math.ceil((DATA_SECONDS + len(ARMS) * per_arm * width) / 60))


def say(text: str) -> None:
    print(text, flush=True)


def elapsed(t0: float) -> str:
    s = int(time.monotonic() - t0)
    return f"{s // 60} min {s % 60:02d} s"

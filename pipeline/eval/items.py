"""Per-item eval results and per-sequence validation losses: the one owner of their files and of bits per byte.

Per-item file, one per scored step: ``<run_dir>/eval/items/step-<NNNNNNN>.csv.gz``, a gzip (mtime 0, so the
same scores give the same bytes) of a CSV with one row per (task, item), sorted by task and lm-eval's doc_id:

    task,item,acc,acc_norm,gold_loglik,gold_bytes

``item`` is ``<doc_id>-<8 hex>``, the hex a hash of the item's gold context and gold continuation, so a
comparison can check that two runs answered the same item. ``acc``/``acc_norm`` are 0/1 (acc_norm empty
where the task has none); ``gold_loglik`` is the gold continuation's log-likelihood in nats (float32, as
the model computed it) and ``gold_bytes`` its UTF-8 length. ~19 bytes per item after gzip. Written by
`prism eval` on a checkpoint and by the evals during training; logged to the run under ``eval_items/``.

Per-sequence validation losses: ``<run_dir>/val/[<set>/]step-<NNNNNNN>.npy``, float32, one mean loss per
fixed validation row in the set's row order (the run's own val split directly under val/, data.val_sets
by name below it, as their metrics are val/loss and val/<set>/loss); logged under ``val_items/[<set>/]``.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.atomic import write_atomic

ITEMS_ARTIFACT_DIR = "eval_items"
VAL_ARTIFACT_DIR = "val_items"
COLUMNS = ("task", "item", "acc", "acc_norm", "gold_loglik", "gold_bytes")


@dataclass
class TaskItems:
    """One task's items in doc order; ``acc_norm`` is None for a task without it."""

    ids: list[str]
    acc: np.ndarray  # int8, 0/1
    acc_norm: np.ndarray | None
    gold_loglik: np.ndarray  # float64 nats
    gold_bytes: np.ndarray  # int64

    @property
    def bpb(self) -> float:
        return bits_per_byte(self.gold_loglik, self.gold_bytes)


def bits_per_byte(gold_loglik: Any, gold_bytes: Any) -> float:
    """−Σ log-likelihood / (ln 2 · Σ bytes) of the gold continuations: bits the model needs per byte of answer."""
    total_bytes = float(np.sum(gold_bytes))
    return -float(np.sum(gold_loglik)) / (math.log(2) * total_bytes) if total_bytes > 0 else math.nan


def step_name(step: int, suffix: str) -> str:
    return f"step-{step:07d}{suffix}"


# --- per-item eval results --------------------------------------------------------------------------
def gold_index(task: str, sample: dict[str, Any]) -> int | None:
    """The gold choice of one lm-eval multiple-choice sample, as lm-eval's process_results finds it; None when
    it cannot be told from the sample (a multiple-input task other than winogrande)."""
    target, arguments = sample["target"], sample["arguments"]
    if isinstance(target, int):
        return target
    if len({context for context, _ in arguments}) == 1:  # one context, the choices are the continuations
        choices = [continuation.strip() for _, continuation in arguments]
        return choices.index(str(target).strip()) if str(target).strip() in choices else None
    if task == "winogrande":  # multiple-input: lm-eval's gold is the task's doc_to_text (the answer's index)
        from lm_eval.tasks.winogrande.preprocess_winogrande import doc_to_text

        return int(doc_to_text(sample["doc"]))
    return None


def item_id(doc_id: int, context: str, continuation: str) -> str:
    digest = hashlib.sha1(f"{context}\x1f{continuation}".encode()).hexdigest()[:8]
    return f"{doc_id}-{digest}"


def task_items(task: str, samples: list[dict[str, Any]]) -> TaskItems | None:
    """lm-eval's logged samples of one task as TaskItems (doc order); None where a gold is not known."""
    rows = []
    for s in sorted(samples, key=lambda s: s["doc_id"]):  # under DP lm-eval chains the ranks' shares
        gold = gold_index(task, s)
        if gold is None:
            return None
        context, continuation = s["arguments"][gold]
        rows.append(
            (
                item_id(s["doc_id"], context, continuation),
                int(s["acc"]),
                int(s["acc_norm"]) if "acc_norm" in s else -1,
                float(np.float32(s["filtered_resps"][gold][0])),
                len(continuation.encode("utf-8")),
            )
        )
    acc_norm = np.array([r[2] for r in rows], dtype=np.int8)
    return TaskItems(
        [r[0] for r in rows],
        np.array([r[1] for r in rows], dtype=np.int8),
        acc_norm if rows and "acc_norm" in samples[0] else None,
        np.array([r[3] for r in rows], dtype=np.float64),
        np.array([r[4] for r in rows], dtype=np.int64),
    )


def encode_items(items: dict[str, TaskItems]) -> bytes:
    """The file's bytes: deterministic for the same items (sorted tasks, gzip mtime 0)."""
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(COLUMNS)
    for task in sorted(items):
        t = items[task]
        for i, item in enumerate(t.ids):
            norm = "" if t.acc_norm is None else int(t.acc_norm[i])
            # float32's 9 significant digits round-trip the model's value exactly
            writer.writerow((task, item, int(t.acc[i]), norm, f"{t.gold_loglik[i]:.9g}", int(t.gold_bytes[i])))
    # level 1: level 9 would save about a tenth of the bytes at several times the time
    return gzip.compress(text.getvalue().encode(), compresslevel=1, mtime=0)


def decode_items(data: bytes) -> dict[str, TaskItems]:
    rows = list(csv.reader(io.StringIO(gzip.decompress(data).decode())))
    if not rows or tuple(rows[0]) != COLUMNS:
        raise ValueError(f"not a per-item eval file: header {rows[0] if rows else 'missing'}, want {','.join(COLUMNS)}")
    by_task: dict[str, list[list[str]]] = {}
    for row in rows[1:]:
        by_task.setdefault(row[0], []).append(row)
    out = {}
    for task, task_rows in by_task.items():
        has_norm = task_rows[0][3] != ""
        out[task] = TaskItems(
            [r[1] for r in task_rows],
            np.array([int(r[2]) for r in task_rows], dtype=np.int8),
            np.array([int(r[3]) for r in task_rows], dtype=np.int8) if has_norm else None,
            np.array([float(r[4]) for r in task_rows], dtype=np.float64),
            np.array([int(r[5]) for r in task_rows], dtype=np.int64),
        )
    return out


def items_path(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "eval" / "items" / step_name(step, ".csv.gz")


def items_artifact(step: int) -> str:
    """The file's path among a run's MLflow artifacts."""
    return f"{ITEMS_ARTIFACT_DIR}/{step_name(step, '.csv.gz')}"


def write_items(run_dir: str | Path, step: int, items: dict[str, TaskItems]) -> tuple[Path, bytes]:
    """Write (or, for a replayed step, rewrite) a step's per-item file atomically; returns its path and bytes."""
    data = encode_items(items)
    path = items_path(run_dir, step)
    write_atomic(path, data)
    return path, data


# --- per-sequence validation losses -----------------------------------------------------------------
def val_folder(set_name: str | None) -> str:
    """val for the run's own val split (metric val/loss), val/<set> for a named set (val/<set>/loss)."""
    return "val" if set_name is None else f"val/{set_name}"


def val_path(run_dir: str | Path, set_name: str | None, step: int) -> Path:
    return Path(run_dir) / val_folder(set_name) / step_name(step, ".npy")


def val_artifact(set_name: str | None, step: int) -> str:
    folder = VAL_ARTIFACT_DIR if set_name is None else f"{VAL_ARTIFACT_DIR}/{set_name}"
    return f"{folder}/{step_name(step, '.npy')}"


def encode_val(losses: Any) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.asarray(losses, dtype=np.float32), allow_pickle=False)
    return buf.getvalue()


def decode_val(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)


def write_val(run_dir: str | Path, set_name: str | None, step: int, losses: Any) -> tuple[Path, bytes]:
    """Write a validation's per-sequence losses atomically; returns the path and the bytes."""
    data = encode_val(losses)
    path = val_path(run_dir, set_name, step)
    write_atomic(path, data)
    return path, data

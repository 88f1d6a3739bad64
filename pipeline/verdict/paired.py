"""The paired tables of `prism compare`: both arms scored on the same items, and on the same validation tokens.

Downstream: per (scale, Prism schedule vs uniform, task, step) where each seed pair (seed_pairs below: the
same seed on the same data order) was scored on the same items (the item ids of pipeline.eval.items equal):
Δ accuracy (acc_norm where the task has it, else acc), with the exact McNemar p on the discordant items
when there is one seed pair, and a paired bootstrap interval resampling the items (and the seed pairs, when
there are several); Δ bits per byte with its paired bootstrap interval. Validation: per seed pair, the
paired Δ of the final per-sequence losses with a t interval over the sequences, beside the seed-level
interval of the main table. Every number is read from the runs' MLflow artifacts (eval_items/, val_items/).
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline import statistics
from pipeline.checkpoint import tag_step
from pipeline.eval import items as eval_items
from pipeline.eval.comparison import to_csv

ITEM_NOISE = "items (eval sample)"
ITEM_SEED_NOISE = "items + seeds (eval sample and training noise)"
SEQUENCE_NOISE = "sequences (val sample)"
SEED_NOISE = "seeds (training noise)"


@dataclass
class ArmPair:
    """One (scale, Prism schedule) against uniform: its seed pairs, (uniform run, prism run) each."""

    scale: str
    schedule: str
    pairs: list[tuple[Any, Any]]


class ArtifactReader:
    """Per-item and per-sequence files of runs, read from their MLflow artifacts (cached per run)."""

    def __init__(self, tracking_uri: str, folder: str):
        from pipeline.tracking import store

        self.client = store.client(tracking_uri)
        self.folder = folder  # where downloads go
        self.listed: dict[tuple[str, str], list[str]] = {}

    def steps(self, run_id: str, folder: str) -> dict[int, str]:
        """step -> artifact path of the step-<NNNNNNN>.* files directly under ``folder``."""
        if (run_id, folder) not in self.listed:
            self.listed[(run_id, folder)] = [f.path for f in self.client.list_artifacts(run_id, folder) if not f.is_dir]
        out = {}
        for path in self.listed[(run_id, folder)]:
            step = tag_step(Path(path).name.split(".")[0])  # step-<NNNNNNN>, a checkpoint tag's spelling
            if step is not None:
                out[step] = path
        return out

    def read(self, run_id: str, path: str) -> bytes:
        from pipeline.tracking.store import download_artifact

        return download_artifact(self.client, run_id, path, self.folder).read_bytes()


def seed_pairs(uniform: list[Any], prism: list[Any]) -> list[tuple[Any, Any]]:
    """(uniform, prism) runs (compare.RunSeries) that saw the same batches: the same seed on the same data
    order (compare.data_order). The one pairing rule: the seed-level test of compare pairs by it too."""
    u = {(r.seed, r.data_order): r for r in uniform}
    return [(u[(r.seed, r.data_order)], r) for r in prism if (r.seed, r.data_order) in u]


def arm_pairs(runs: list[Any]) -> list[ArmPair]:
    """Per (scale, Prism schedule), its seed pairs with the scale's uniform runs; schedules without any left out."""
    out = []
    for scale in sorted({r.scale for r in runs}):
        uniform = [r for r in runs if r.scale == scale and r.arm == "uniform"]
        for schedule in sorted({r.schedule for r in runs if r.scale == scale and r.arm == "prism"}):
            prism = [r for r in runs if r.scale == scale and r.arm == "prism" and r.schedule == schedule]
            pairs = seed_pairs(uniform, prism)
            if pairs:
                out.append(ArmPair(scale, schedule, pairs))
    return out


# --- downstream: item-paired -----------------------------------------------------------------------------
def shown_metric(items: eval_items.TaskItems) -> str:
    return "acc" if items.acc_norm is None else "acc_norm"


def bits_per_item(t: eval_items.TaskItems) -> np.ndarray:
    """Each item's share of the task's bpb: their mean is the task's bpb (the bytes are the same in both arms)."""
    return -t.gold_loglik / (math.log(2) * float(np.mean(t.gold_bytes)))


def task_rows(
    group: ArmPair, task: str, step: int, pairs: list[tuple[tuple[Any, Any], tuple[Any, Any]]]
) -> tuple[dict | None, str | None]:
    """One downstream row from seed pairs ((uniform run, prism run), (their TaskItems of ``task``)), or why
    the task is left out."""
    for (u_run, p_run), (u, p) in pairs:
        if u.ids != p.ids:
            return None, f"{task} at step {step}: item ids differ between {u_run.name} and {p_run.name}"
        if u.ids != pairs[0][1][0].ids:
            return None, f"{task} at step {step}: seed pairs were scored on different items"
    scored = [items for _, items in pairs]
    metric = shown_metric(scored[0][0])
    correct = [(getattr(u, metric), getattr(p, metric)) for u, p in scored]
    a, b = np.array([c[0] for c in correct], float), np.array([c[1] for c in correct], float)
    acc = statistics.paired_bootstrap(a, b)
    bits = statistics.paired_bootstrap(
        np.array([bits_per_item(u) for u, _ in scored]), np.array([bits_per_item(p) for _, p in scored])
    )
    one_pair = len(scored) == 1
    mcnemar = statistics.mcnemar(int(np.sum(a > b)), int(np.sum(b > a))) if one_pair else math.nan
    return {
        "scale": group.scale,
        "schedule": group.schedule,
        "task": task,
        "step": step,
        "metric": metric,
        "seed_pairs": len(scored),
        "items": a.shape[1],
        "uniform": float(a.mean()),
        "prism": float(b.mean()),
        "delta": acc.mean,
        "mcnemar_p": mcnemar,
        "delta_ci95_low": acc.low,
        "delta_ci95_high": acc.high,
        "bpb_uniform": float(np.mean([u.bpb for u, _ in scored])),
        "bpb_prism": float(np.mean([p.bpb for _, p in scored])),
        "delta_bpb": bits.mean,
        "delta_bpb_ci95_low": bits.low,
        "delta_bpb_ci95_high": bits.high,
        "noise": ITEM_NOISE if one_pair else ITEM_SEED_NOISE,
    }, None


def downstream(groups: list[ArmPair], reader: ArtifactReader) -> tuple[list[dict], list[str]]:
    """Rows for every (group, task, step) at which seed pairs were scored in both arms (those pairs), and the
    lines saying what was left out."""
    rows, left_out = [], []
    for group in groups:
        files = {r.run_id: reader.steps(r.run_id, eval_items.ITEMS_ARTIFACT_DIR) for pair in group.pairs for r in pair}
        for step in sorted(set().union(*(files[u.run_id].keys() & files[p.run_id].keys() for u, p in group.pairs))):
            pairs = [(u, p) for u, p in group.pairs if step in files[u.run_id] and step in files[p.run_id]]
            read = {
                r.run_id: eval_items.decode_items(reader.read(r.run_id, files[r.run_id][step]))
                for pair in pairs
                for r in pair
            }
            for task in sorted(set.intersection(*(set(read[r.run_id]) for pair in pairs for r in pair))):
                scored = [((u, p), (read[u.run_id][task], read[p.run_id][task])) for u, p in pairs]
                row, why = task_rows(group, task, step, scored)
                rows += [row] if row else []
                left_out += [f"{group.scale} {group.schedule}: {why}"] if why else []
    return rows, left_out


# --- validation: sequence-paired -------------------------------------------------------------------------
def validation(groups: list[ArmPair], reader: ArtifactReader, seed_level: dict[tuple[str, str], str]) -> list[dict]:
    """Per seed pair: Δ of the final per-sequence val losses (the last step both logged) with its t interval."""
    rows = []
    for group in groups:
        for u_run, p_run in group.pairs:
            u_steps = reader.steps(u_run.run_id, eval_items.VAL_ARTIFACT_DIR)
            p_steps = reader.steps(p_run.run_id, eval_items.VAL_ARTIFACT_DIR)
            common = set(u_steps) & set(p_steps)
            if not common:
                continue
            step = max(common)
            a = eval_items.decode_val(reader.read(u_run.run_id, u_steps[step]))
            b = eval_items.decode_val(reader.read(p_run.run_id, p_steps[step]))
            if a.shape != b.shape:
                continue  # other validation sizes: not the same tokens
            diff = statistics.paired_difference(a.astype(float), b.astype(float))
            rows.append(
                {
                    "scale": group.scale,
                    "schedule": group.schedule,
                    "seed_pair": f"{u_run.name} vs {p_run.name}",
                    "step": step,
                    "sequences": len(a),
                    "delta": diff.mean,
                    "delta_ci95_low": diff.low,
                    "delta_ci95_high": diff.high,
                    "p_value": diff.p_value,
                    "test": "paired t over sequences",
                    "seed_level": seed_level.get((group.scale, group.schedule), ""),
                }
            )
    return rows


# --- the section -----------------------------------------------------------------------------------------
def _ci(low: float, high: float, digits: int = 4) -> str:
    return "n/a" if math.isnan(low) else f"[{low:+.{digits}f}, {high:+.{digits}f}]"


def seed_level_cells(rows: list[dict[str, Any]]) -> dict[tuple[str, str], str]:
    """(scale, schedule) -> the main table's Δ [95 % CI] (its test) over seeds, for the validation column."""
    out = {}
    for r in rows:
        if r["arm"] != "prism" or math.isnan(r["delta_vs_uniform"]):
            continue
        ci = _ci(r["delta_ci95_low"], r["delta_ci95_high"])
        test = r["delta_test"] if not math.isnan(r["delta_ci95_low"]) else "needs ≥ 2 seeds"
        out[(r["scale"], r["schedule"])] = f"{r['delta_vs_uniform']:+.4f} {ci} ({test})"
    return out


def markdown(down: list[dict], left_out: list[str], val: list[dict]) -> str:
    out = ["", "### Paired downstream comparison (same items in both arms)", ""]
    if down:
        out += [
            "| scale | schedule | task | step | metric | seed pairs | items | uniform | prism | Δ Prism − uniform "
            "| McNemar p (exact; items) | 95 % CI (paired bootstrap) | noise the CI measures | Δ bpb "
            "| Δ bpb 95 % CI (paired bootstrap) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in down:
            p = "n/a (> 1 seed pair)" if math.isnan(r["mcnemar_p"]) else f"{r['mcnemar_p']:.3f}"
            out.append(
                f"| {r['scale']} | {r['schedule']} | {r['task']} | {r['step']} | {r['metric']} | {r['seed_pairs']} "
                f"| {r['items']} | {r['uniform']:.3f} | {r['prism']:.3f} | {r['delta']:+.4f} | {p} "
                f"| {_ci(r['delta_ci95_low'], r['delta_ci95_high'])} | {r['noise']} | {r['delta_bpb']:+.4f} "
                f"| {_ci(r['delta_bpb_ci95_low'], r['delta_bpb_ci95_high'])} |"
            )
        out += [
            "",
            "Δ > 0 in accuracy and Δ < 0 in bits per byte (bpb, of the gold answer) mean Prism better. McNemar: exact "
            "binomial test on the items one arm got right and the other wrong (one seed pair). Paired bootstrap: "
            "the items resampled, and the seed pairs too when there are several. See docs/verdict.md.",
        ]
    else:
        out.append(
            "No seed pair of this experiment has per-item eval results in both arms (eval_items/ artifacts: "
            "train with train.eval_every or run `prism eval` on both arms' checkpoints)."
        )
    out += [f"Left out: {why}." for why in left_out]
    out += ["", "### Paired validation loss (same validation sequences in both arms)", ""]
    if val:
        out += [
            f"| scale | schedule | seed pair | step | sequences | Δ Prism − uniform | 95 % CI: {SEQUENCE_NOISE} "
            f"| p (paired t over sequences) | 95 % CI: {SEED_NOISE} (all seeds, main table) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in val:
            out.append(
                f"| {r['scale']} | {r['schedule']} | {r['seed_pair']} | {r['step']} | {r['sequences']} "
                f"| {r['delta']:+.4f} | {_ci(r['delta_ci95_low'], r['delta_ci95_high'])} | {r['p_value']:.3g} "
                f"| {r['seed_level']} |"
            )
        out += [
            "",
            "The sequence interval says how sure this one pair's Δ is given which validation text was drawn; the "
            "seed interval says how much Δ moves with the training seed. A claim about the arms needs the second.",
        ]
    else:
        out.append("No seed pair of this experiment logged per-sequence validation losses in both arms (val_items/).")
    return "\n".join(out) + "\n"


def section(runs: list[Any], summary_rows: list[dict[str, Any]], tracking_uri: str) -> tuple[str, dict[str, str]]:
    """The Markdown section and the CSVs ({file name: text}, the tables that have rows) of the paired comparison
    of ``runs`` (compare.RunSeries); ``summary_rows``: compare.summarize's, for the seed-level interval beside
    the sequence-level one."""
    groups = arm_pairs(runs)
    if not groups:
        text = "\n### Paired comparisons\n\nNo uniform and Prism runs share a seed and a data order: nothing to pair.\n"
        return text, {}
    with tempfile.TemporaryDirectory(prefix="prism-paired-") as folder:
        reader = ArtifactReader(tracking_uri, folder)
        down, left_out = downstream(groups, reader)
        val = validation(groups, reader, seed_level_cells(summary_rows))
    csvs = {"paired_downstream.csv": to_csv(down), "paired_validation.csv": to_csv(val)}
    return markdown(down, left_out, val), {name: text for name, text in csvs.items() if text}

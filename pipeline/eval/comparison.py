"""Downstream accuracy against tokens for the arms comparison (`prism compare`, pipeline.compare).

Reads each run's eval/<task>/<metric> histories (logged by the evals during training and by `prism eval` on a
checkpoint, at the step's tokens) from the RunSeries that pipeline.compare loads. Per (scale, arm, schedule),
task and step: the mean over the seeds that were scored there, and Student's t 95 % interval when at least two
were. The table shows one metric per task, acc_norm where the task has it (length-normalised, the usual
choice for HellaSwag and ARC), else acc; the CSV holds every metric. The plot draws each task beside the
loss curves: mean line, interval band, the measured points.
"""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path
from typing import Any

from pipeline import statistics

ARMS = ("uniform", "prism")


def preferred_metrics(keys: set[str]) -> dict[str, str]:
    """task -> the metric the table shows: acc_norm when logged for it, else acc (keys are task/metric)."""
    tasks = sorted({k.split("/")[0] for k in keys})
    return {t: "acc_norm" if f"{t}/acc_norm" in keys else "acc" for t in tasks}


def summarize(runs: list[Any]) -> list[dict[str, Any]]:
    """One row per (scale, arm, schedule, task, metric, step) with the mean over seeds and its interval."""
    rows = []
    for scale in sorted({r.scale for r in runs}):
        groups = sorted({(r.arm, r.schedule) for r in runs if r.scale == scale}, key=lambda k: (ARMS.index(k[0]), k[1]))
        for arm, schedule in groups:
            group = [r for r in runs if (r.scale, r.arm, r.schedule) == (scale, arm, schedule)]
            for key in sorted({k for r in group for k in r.evals}):
                task, metric = key.split("/", 1)
                points: dict[int, list[tuple[float, float]]] = {}
                for r in group:
                    for step, tokens, value in r.evals.get(key, []):
                        points.setdefault(step, []).append((tokens, value))
                for step in sorted(points):
                    values = [v for _, v in points[step]]
                    mean, low, high = statistics.mean_interval(values)
                    rows.append(
                        {
                            "scale": scale,
                            "arm": arm,
                            "schedule": schedule,
                            "task": task,
                            "metric": metric,
                            "step": step,
                            "tokens": sum(t for t, _ in points[step]) / len(values),
                            "runs": len(values),
                            "mean": mean,
                            "ci95_low": low,
                            "ci95_high": high,
                        }
                    )
    return rows


def _cell(row: dict[str, Any] | None) -> str:
    if row is None:
        return "—"
    if math.isnan(row["ci95_low"]):
        return f"{row['mean']:.3f} (n=1)"
    return f"{row['mean']:.3f} [{row['ci95_low']:.3f}, {row['ci95_high']:.3f}]"


def markdown(rows: list[dict[str, Any]]) -> str:
    """The table: per (scale, arm, schedule) and step, one column per task (its preferred metric)."""
    if not rows:
        return ""
    shown = preferred_metrics({f"{r['task']}/{r['metric']}" for r in rows})
    header = " | ".join(f"{t} {m}" for t, m in shown.items())
    out = [
        "",
        "Downstream zero-shot accuracy against tokens (mean over seeds [95 % CI], n=1: one seed, no interval):",
        "",
        f"| scale | arm | schedule | step | tokens | {header} |",
        "|---|---|---|---|---|" + "---|" * len(shown),
    ]
    index = {(r["scale"], r["arm"], r["schedule"], r["step"], r["task"], r["metric"]): r for r in rows}
    points = sorted(
        {
            (r["scale"], r["arm"], r["schedule"], r["step"], r["tokens"])
            for r in rows
            if shown.get(r["task"]) == r["metric"]
        },
        key=lambda p: (p[0], ARMS.index(p[1]), p[2], p[3]),
    )
    for scale, arm, schedule, step, tokens in points:
        cells = [_cell(index.get((scale, arm, schedule, step, t, m))) for t, m in shown.items()]
        out.append(f"| {scale} | {arm} | {schedule} | {step} | {tokens:,.0f} | {' | '.join(cells)} |")
    out.append(
        "acc_norm: answers ranked by log-likelihood per character (lm-eval); acc where a task has no acc_norm. Every "
        "metric is in accuracy_vs_tokens.csv."
    )
    return "\n".join(out) + "\n"


def to_csv(rows: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    if rows:
        writer = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
        writer.writeheader()
        for r in rows:
            writer.writerow({k: ("" if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()})
    return buf.getvalue()


def plot(rows: list[dict[str, Any]], out_dir: Path, save: Any, tick: Any) -> list[Path]:
    """Per scale, one panel per task (its preferred metric): accuracy vs tokens per arm. pipeline.compare passes
    its figure writer (``save``, atomic) and token-axis labels (``tick``), so both plots read alike."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    paths = []
    palette = ["tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown"]
    for scale in sorted({r["scale"] for r in rows}):
        at_scale = [r for r in rows if r["scale"] == scale]
        shown = preferred_metrics({f"{r['task']}/{r['metric']}" for r in at_scale})
        keys = sorted({(r["arm"], r["schedule"]) for r in at_scale}, key=lambda k: (ARMS.index(k[0]), k[1]))
        colors = {k: "tab:blue" if k[0] == "uniform" else palette[i % len(palette)] for i, k in enumerate(keys)}
        cols = min(2, len(shown))
        fig, axes = plt.subplots(-(-len(shown) // cols), cols, figsize=(5.2 * cols, 3.6 * -(-len(shown) // cols)))
        for ax, (task, metric) in zip(getattr(axes, "flat", [axes]), shown.items()):
            for key in keys:
                line = [
                    r for r in at_scale if (r["arm"], r["schedule"], r["task"], r["metric"]) == (*key, task, metric)
                ]
                if not line:
                    continue
                x, y = [r["tokens"] for r in line], [r["mean"] for r in line]
                label = key[0] if key[0] == "uniform" else f"prism {key[1]}"
                ax.plot(x, y, "o-", ms=4, color=colors[key], label=f"{label} (n={max(r['runs'] for r in line)})")
                if any(not math.isnan(r["ci95_low"]) for r in line):
                    ax.fill_between(
                        x,
                        [r["ci95_low"] for r in line],
                        [r["ci95_high"] for r in line],
                        color=colors[key],
                        alpha=0.2,
                        lw=0,
                    )
            ax.set(title=f"{task} ({metric})", xlabel="training tokens", ylabel="accuracy")
            ax.xaxis.set_major_formatter(FuncFormatter(tick))
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        for ax in list(getattr(axes, "flat", [axes]))[len(shown) :]:
            ax.set_visible(False)
        fig.suptitle(f"{scale}: zero-shot accuracy vs tokens (line: mean over seeds, band: 95 % CI)")
        paths.append(save(fig, out_dir / f"accuracy_vs_tokens_{scale}.png"))
    return paths

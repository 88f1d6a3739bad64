"""Files for D_l and ΔD_l: CSV + JSON tables and PNG plots (the paper's Fig. 4 for the comparison)."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

from pipeline.atomic import write_atomic

COLUMNS = ("layer", "D", "std", "heads", "head_dim", "sequences")
DELTA_COLUMNS = ("layer", "delta", "delta_se", "D_prism", "D_uniform", "heads_prism", "heads_uniform")


def write_table(rows: list[dict[str, Any]], columns: tuple[str, ...], meta: dict[str, Any], stem: Path) -> list[Path]:
    """``stem``.csv (one row per layer) and ``stem``.json ({**meta, "layers": rows})."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows({k: r[k] for k in columns} for r in rows)
    csv_path, json_path = stem.with_suffix(".csv"), stem.with_suffix(".json")
    write_atomic(csv_path, buf.getvalue().encode())
    write_atomic(json_path, (json.dumps({**meta, "layers": rows}, indent=2) + "\n").encode())
    return [csv_path, json_path]


def _save(fig: Any, path: Path) -> Path:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    write_atomic(path, buf.getvalue())
    return path


def plot_distance(series: dict[str, list[dict[str, Any]]], path: Path, title: str) -> Path:
    """D_l per layer, one line per label (error bars: std over sequences)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for label, rows in series.items():
        ax.errorbar(
            [r["layer"] for r in rows],
            [r["D"] for r in rows],
            yerr=[r["std"] for r in rows],
            marker="o",
            capsize=3,
            label=label,
        )
    ax.set_xlabel("layer")
    ax.set_ylabel("attention distance $D_l$ (tokens)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, title="error bars: ±1 std over sequences", title_fontsize=8)
    try:
        return _save(fig, path)
    finally:
        plt.close(fig)


def progressive_stages(heads: list[int] | tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(first layer, last layer, heads) for each stage before the baseline head count (1-based)."""
    stages: list[tuple[int, int, int]] = []
    for layer, h in enumerate(heads, start=1):
        if h == heads[-1]:
            break
        if stages and stages[-1][2] == h:
            stages[-1] = (stages[-1][0], layer, h)
        else:
            stages.append((layer, layer, h))
    return stages


def plot_delta(rows: list[dict[str, Any]], prism_heads: list[int] | tuple[int, ...], path: Path, title: str) -> Path:
    """ΔD_l = D_l(Prism) − D_l(uniform) per layer, progressive-phase layers shaded (paper Fig. 4)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for i, (first, last, h) in enumerate(progressive_stages(prism_heads)):
        ax.axvspan(first - 0.5, last + 0.5, color="tab:orange", alpha=0.10 + 0.08 * (i % 2), lw=0)
        ax.text(
            (first + last) / 2, 1.0, f"h={h}", transform=ax.get_xaxis_transform(), ha="center", va="bottom", fontsize=8
        )
    layers = [r["layer"] for r in rows]
    ax.bar(
        layers,
        [r["delta"] for r in rows],
        yerr=[r["delta_se"] for r in rows],
        capsize=3,
        color=["tab:blue" if r["delta"] < 0 else "tab:red" for r in rows],
    )
    ax.axhline(0.0, color="black", lw=0.8)
    ax.set_xticks(layers)
    ax.set_xlabel("layer (shaded: Prism's progressive phase)")
    ax.set_ylabel("$\\Delta D_l$ = Prism − uniform (tokens)\nbelow 0 = Prism attends more locally", fontsize=9)
    ax.set_title(title, pad=14, fontsize=10)
    ax.text(0.99, 0.02, "error bars: ±1 standard error", transform=ax.transAxes, ha="right", va="bottom", fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    try:
        return _save(fig, path)
    finally:
        plt.close(fig)

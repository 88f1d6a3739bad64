"""Annealed points in the comparison: each cooldown branch's final validation loss is one point at
(scale, arm, schedule, tokens). A cosine run's earlier checkpoints sit at a high learning rate; a branch
decayed to min_lr is what a run of that length reaches, so the arms are compared at each budget annealed.
A main run's own final point is annealed too (its WSD decay, or cosine's end at min_lr: scaling.
final_point_annealed decides, for the scaling fit as here): beside its branches it is the point at its full
tokens, labelled "main run's own decay".

Per (scale, tokens): the annealed val loss of each arm (mean ± std over seeds) and Δ Prism − uniform with its
95 % interval and p, paired by seed where both arms ran the same seeds on the same data order, Welch otherwise
(compare.arm_difference, handed in by compare: the same test as the main table's). A plot per scale draws the
main runs' curves with the annealed points beside them. The branch runs come from compare.load_runs(...,
branches=True), which keeps them out of the main curves and tables; compare calls this module, never the reverse.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline import statistics

if TYPE_CHECKING:
    from pipeline.compare import RunSeries

Difference = Callable[[list["RunSeries"], list["RunSeries"]], statistics.Difference]  # compare.arm_difference


def _arm_order(arm: str) -> int:
    return 0 if arm == "uniform" else 1


def end_tokens(run: RunSeries) -> float:
    """Where a branch's annealed point sits: the tokens of its last validation."""
    return run.val[-1][1] if run.val else math.nan


MAIN_RUN = "main run's own decay"  # the from-step cell of a main run's final point


def source(run: RunSeries) -> str:
    """Where an annealed point comes from: the branch's step in its main run, or the main run's own decay."""
    return MAIN_RUN if run.branch_step is None else str(run.branch_step)


def main_run_ends(main_runs: list[RunSeries], tracking_uri: str) -> list[RunSeries]:
    """The finished main runs whose final point is annealed (scaling.final_point_annealed, on the config each
    run logged)."""
    from pipeline.tracking import store
    from pipeline.verdict.scaling import final_point_annealed, run_config

    client = store.client(tracking_uri)
    done = [r for r in main_runs if r.status == "FINISHED" and r.val]
    return [r for r in done if final_point_annealed(r, run_config(client, r.run_id))]


def summarize(branches: list[RunSeries], arm_difference: Difference) -> list[dict[str, Any]]:
    """One row per (scale, tokens, arm, schedule) of the annealed points (branches, and main runs' own ends),
    Prism rows with Δ against uniform."""
    rows: list[dict[str, Any]] = []
    measured = [r for r in branches if r.val]
    for scale, tokens in sorted({(r.scale, end_tokens(r)) for r in measured}):
        here = [r for r in measured if (r.scale, end_tokens(r)) == (scale, tokens)]
        uniform = [r for r in here if r.arm == "uniform"]
        for arm, schedule in sorted({(r.arm, r.schedule) for r in here}, key=lambda k: (_arm_order(k[0]), k[1])):
            group = [r for r in here if (r.arm, r.schedule) == (arm, schedule)]
            mean, std = statistics.mean_std([r.final_val_loss for r in group])
            diff = arm_difference(uniform, group) if arm == "prism" and uniform else None
            rows.append(
                {
                    "scale": scale,
                    "tokens": int(tokens),
                    "arm": arm,
                    "schedule": schedule,
                    "branch_steps": ",".join(sorted({source(r) for r in group})),
                    "seeds": ",".join(r.seed for r in group),
                    "annealed_val_loss_mean": mean,
                    "annealed_val_loss_std": std,
                    **statistics.difference_columns(diff),
                }
            )
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return ""
    out = [
        "",
        "### Annealed points (cooldown branches)",
        "",
        "Each branch's final val loss after its decay to min_lr, at the tokens it ended on; each main run's own "
        "final point (its decay's end) at its full tokens.",
        "",
        "| scale | tokens | arm | schedule | from step | seeds | annealed val loss (mean ± std) "
        "| Δ Prism − uniform [95 % CI] | p (test) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        std = "n/a" if math.isnan(r["annealed_val_loss_std"]) else f"{r['annealed_val_loss_std']:.4f}"
        delta, p = statistics.difference_cells(r)
        out.append(
            f"| {r['scale']} | {r['tokens']:,} | {r['arm']} | {r['schedule']} | {r['branch_steps']} | "
            f"{len(r['seeds'].split(','))} | {r['annealed_val_loss_mean']:.4f} ± {std} | {delta} | {p} |"
        )
    return "\n".join(out) + "\n"


def plot(
    rows: list[dict[str, Any]], main_runs: list[RunSeries], out_dir: Path, save: Callable[[Any, Path], Path]
) -> list[Path]:
    """Per scale: each arm's main runs (their measured val losses) and its annealed points (mean, ±1 std)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    paths: list[Path] = []
    for scale in sorted({r["scale"] for r in rows}):
        fig, ax = plt.subplots(figsize=(6.8, 4.4))
        keys = sorted({(r["arm"], r["schedule"]) for r in rows if r["scale"] == scale}, key=lambda k: _arm_order(k[0]))
        for i, (arm, schedule) in enumerate(keys):
            color = "tab:blue" if arm == "uniform" else ["tab:orange", "tab:green", "tab:red"][i % 3]
            mains = [r for r in main_runs if (r.scale, r.arm, r.schedule) == (scale, arm, schedule) and r.val]
            for n, run in enumerate(mains):
                tokens, losses = [t for _, t, _ in run.val], [v for _, _, v in run.val]
                ax.plot(tokens, losses, color=color, alpha=0.4, lw=1, label=None if n else f"{arm} main run")
            pts = [r for r in rows if (r["scale"], r["arm"], r["schedule"]) == (scale, arm, schedule)]
            ax.errorbar(
                [r["tokens"] for r in pts],
                [r["annealed_val_loss_mean"] for r in pts],
                yerr=[0.0 if math.isnan(r["annealed_val_loss_std"]) else r["annealed_val_loss_std"] for r in pts],
                fmt="o--",
                color=color,
                capsize=3,
                label=f"{arm} annealed",
            )
        ax.set(xlabel="training tokens", ylabel="validation loss (nats/token)")
        ax.set_title(f"{scale}: annealed loss vs tokens (cooldown branches)\nline: main run, dots: annealed")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: f"{x / 1e6:g}M"))
        ax.legend()
        ax.grid(alpha=0.3)
        paths.append(save(fig, out_dir / f"annealed_loss_vs_tokens_{scale}.png"))
    return paths


def section(
    branches: list[RunSeries],
    main_runs: list[RunSeries],
    out_dir: Path,
    save: Callable[[Any, Path], Path],
    arm_difference: Difference,
    tracking_uri: str,
) -> tuple[str, list[Path]]:
    """The comparison's annealed section and its plots: the finished branches and the main runs' own annealed
    ends; nothing without finished branches (a lone main run's end is the main table's final loss)."""
    finished = [r for r in branches if r.status == "FINISHED"]
    if not any(r.val for r in finished):
        return "", []
    rows = summarize(finished + main_run_ends(main_runs, tracking_uri), arm_difference)
    return markdown(rows), plot(rows, main_runs, out_dir, save)

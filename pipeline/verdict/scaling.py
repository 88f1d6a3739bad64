"""Does the gap between the arms hold as the model grows? The scaling report of `prism scaling`
(compare.compare_scales: several experiments, one per scale) and of `prism compare` on an experiment that
holds several scales (compare_section).

One point per finished training run (compare.RunSeries, read by compare): arm, seed, the parameter count N of
the config the run logged (pipeline.model_size, never typed by hand), tokens trained D, final validation loss
(val/loss) and run tokens/s (compare's throughput). A cooldown branch of a WSD run (`prism cooldown`;
RunSeries.branch_step set) is one more annealed point at its own D. Every point is annealed
(final_point_annealed: its last validation at its schedule's end, a main run's of either schedule or a branch's);
a run whose last validation came before that is left out. verdict.fits owns the fits and intervals:
L(N) per arm at the study's tokens per parameter when each size has one D, L(N, D) when branches add others;
the gap, the compute multiplier k and k adjusted by tokens/s, each with a bootstrap interval over seeds. This
module checks the points before any fit (data, arms, counts), then writes the table, CSVs and plot.
"""

from __future__ import annotations

import csv
import io
import math
import os
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from pipeline import statistics
from pipeline.atomic import write_atomic
from pipeline.config import Config, ConfigError, from_dict
from pipeline.lr_schedule import ends_annealed
from pipeline.model_size import parameter_count
from pipeline.tracking import store
from pipeline.verdict import fits

if TYPE_CHECKING:
    from pipeline.compare import RunSeries  # compare calls this module: it reads runs, this judges them

PROGRESS_BAR = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"


@dataclass(frozen=True)
class Point:
    """One finished run as the fit sees it: its final validation loss at N parameters after D tokens."""

    arm: str
    scale: str
    seed: str
    N: int
    D: float
    loss: float
    tokens_per_sec: float
    run_id: str
    branch: bool = False  # an annealed cooldown branch (an extra D at this N), not a main run

    def for_fit(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("arm", "N", "D", "loss", "seed", "tokens_per_sec")}


def run_config(client: Any, run_id: str) -> Config:
    """The config a run logged (its config.yaml artifact), rebuilt and validated as `prism train` loaded it."""
    bar = os.environ.get(PROGRESS_BAR)
    os.environ[PROGRESS_BAR] = "false"  # MLflow draws one per download on the terminal
    try:
        with tempfile.TemporaryDirectory() as tmp:
            text = Path(client.download_artifacts(run_id, "config.yaml", tmp)).read_text()
    except Exception as e:  # noqa: BLE001 - MLflow raises several kinds for a missing artifact
        raise ConfigError(f"run {run_id} has no config.yaml artifact ({type(e).__name__}); rerun it") from None
    finally:
        if bar is None:
            os.environ.pop(PROGRESS_BAR)
        else:
            os.environ[PROGRESS_BAR] = bar
    return from_dict(yaml.safe_load(text), f"run {run_id} config.yaml")


def same_data(runs: list[tuple[RunSeries, Config]]) -> None:
    """Refuse sizes that read another tokenizer, dataset or sequence length: their val losses are not one scale.
    The batch and DP size may grow with the model (the paper's 757m doubles the batch): they are allowed."""
    for what, value in (
        ("tokenizer (data.tokenizer)", lambda c: c.data.tokenizer),
        ("dataset (data.dataset_dir)", lambda c: c.data.dataset_dir),
        ("sequence length (model.seq_len)", lambda c: str(c.model.seq_len)),
    ):
        first_run, first = runs[0][0], value(runs[0][1])
        for run, cfg in runs[1:]:
            if value(cfg) != first:
                raise ConfigError(
                    f"mixed {what} across sizes: {first_run.name} ({first_run.scale}) reads {first!r}, {run.name} "
                    f"({run.scale}) reads {value(cfg)!r}; a scaling fit needs every size on the same data"
                )


def final_point_annealed(run: RunSeries, cfg: Config) -> bool:
    """Whether ``run``'s final validation (under its logged ``cfg``) is an annealed point: taken at its schedule's
    end (lr_schedule.ends_annealed), as a finished main run's or cooldown branch's is. compare's annealed table
    and the scaling points read this."""
    return bool(run.val) and ends_annealed(cfg, run.val[-1][0])


def make_points(runs: list[tuple[RunSeries, Config, bool]]) -> list[Point]:
    """(run, its logged config, whether it is a cooldown branch) -> points, after ``same_data``; only annealed
    final points (final_point_annealed) are points."""
    runs = [(r, cfg, branch) for r, cfg, branch in runs if final_point_annealed(r, cfg)]
    if runs:
        same_data([(r, cfg) for r, cfg, _ in runs])
    return [
        Point(
            r.arm,
            r.scale,
            r.seed,
            parameter_count(cfg),
            r.val[-1][1],
            r.final_val_loss,
            r.run_tokens_per_sec,
            r.run_id,
            branch,
        )
        for r, cfg, branch in runs
    ]


def points_of(runs: list[RunSeries], tracking_uri: str) -> list[Point]:
    """The finished runs with a validation loss as points, each with its logged config; a cooldown branch
    (compare.load_runs(..., branches=True): its branch_step is set) is an annealed point."""
    client = store.client(tracking_uri)
    done = [r for r in runs if r.status == "FINISHED" and r.val]
    return make_points([(r, run_config(client, r.run_id), r.branch_step is not None) for r in done])


def check_finished(experiment: str, runs: list[RunSeries]) -> None:
    """Refuse an experiment with no finished run that logged val/loss: it has no point to give."""
    if not any(r.status == "FINISHED" and r.val for r in runs):
        states = ", ".join(sorted({f"{r.name} {r.status}" for r in runs}))
        raise ConfigError(
            f"experiment {experiment!r} holds no FINISHED training run with a validation loss ({states}); "
            "let its runs finish (rerun `prism study` to resume them)"
        )


def fit(points: list[Point]) -> dict[str, Any]:
    """fits.scaling_verdict over the points; too few sizes or points (the fit's ValueError) is bad input."""
    arms = {p.arm for p in points}
    if arms != set(fits.ARMS):
        have = ", ".join(sorted(arms)) or "none"
        raise ConfigError(f"a scaling fit needs both arms (uniform and prism); the runs hold {have}")
    try:
        return fits.scaling_verdict([p.for_fit() for p in points])
    except ValueError as e:
        held = ", ".join(
            f"{arm} {len({p.N for p in points if p.arm == arm})} size(s) in {sum(p.arm == arm for p in points)} "
            "point(s)"
            for arm in fits.ARMS
        )
        raise ConfigError(
            f"too few sizes or points for a scaling fit: {e} (the runs hold {held}); train more widths, e.g. "
            "configs/ladder"
        ) from None


def measured(points: list[Point]) -> list[dict[str, Any]]:
    """Per (N, arm), main runs only: mean ± std of the final val loss over seeds, tokens, tokens/s."""
    rows = []
    for n in sorted({p.N for p in points}):
        for arm in fits.ARMS:
            group = [p for p in points if p.N == n and p.arm == arm and not p.branch]
            if not group:
                continue
            mean, std = statistics.mean_std([p.loss for p in group])
            rows.append(
                {
                    "scale": group[0].scale,
                    "N": n,
                    "arm": arm,
                    "seeds": len(group),
                    "tokens": statistics.mean_std([p.D for p in group])[0],
                    "loss_mean": mean,
                    "loss_std": std,
                    "tokens_per_sec": statistics.mean_std([p.tokens_per_sec for p in group])[0],
                }
            )
    return rows


def _interval(value: float, low: float, high: float, fmt: str) -> str:
    if math.isnan(value):
        return "n/a"
    cell = "∞ (unreachable)" if math.isinf(value) else format(value, fmt)
    if math.isnan(low) or math.isnan(high):
        return f"{cell} [n/a: needs ≥ 2 seeds per size]"
    return f"{cell} [{format(low, fmt)}, {format(high, fmt)}]"


def _law(law: fits.PowerLaw) -> str:
    text = f"{law.E:.3f} + {law.A:.4g}·N^-{law.alpha:.3f}"
    return text if law.beta is None else f"{text} + {law.B:.4g}·D^-{law.beta:.3f}"


def markdown(points: list[Point], verdict: dict[str, Any], title: str) -> str:
    out = [
        f"## Scaling: {title}",
        "",
        "| scale | N (params) | arm | seeds | tokens | tokens/param | final val loss (mean ± std) | run tokens/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m in measured(points):
        out.append(
            f"| {m['scale']} | {m['N']:,.0f} | {m['arm']} | {m['seeds']} | {m['tokens']:,.0f} | {m['tokens'] / m['N']:.3g} "
            f"| {m['loss_mean']:.4f} ± {'n/a' if math.isnan(m['loss_std']) else format(m['loss_std'], '.4f')} "
            f"| {m['tokens_per_sec']:.0f} |"
        )
    branches = sum(p.branch for p in points)
    out += ["", f"Fits ({verdict['form']}, at {verdict['tokens_per_param']:.3g} tokens per parameter):", ""]
    out += [f"- {arm}: L = {_law(law)}" for arm, law in sorted(verdict["fits"].items())]
    out += [
        "",
        "| N (params) | gap Prism − uniform [95 % CI] | k: uniform's compute / Prism's [95 % CI] "
        "| k × run tokens/s ratio (time) [95 % CI] |",
        "|---|---|---|---|",
    ]
    for r in verdict["rows"]:
        out.append(
            f"| {r['N']:,.0f} | {_interval(r['gap'], r['gap_low'], r['gap_high'], '+.4f')} "
            f"| {_interval(r['k'], r['k_low'], r['k_high'], '.3f')} "
            f"| {_interval(r['k_time'], r['k_time_low'], r['k_time_high'], '.3f')} |"
        )
    out += [
        "",
        "gap: the two fits' loss difference at N (< 0: Prism better). k: the compute the uniform arm needs to reach "
        "Prism's loss at N, over Prism's (> 1: Prism saves compute). k × run tokens/s ratio: the same in wall time, "
        "Prism's run tokens/s (compare's) over uniform's. Intervals: bootstrap over seeds within each size and arm, "
        "refitting both arms (training noise, not the validation sample); docs/verdict.md#scaling.",
    ]
    if branches:
        out.append(f"{branches} annealed cooldown-branch point(s) join the main runs in the L(N, D) fit.")
    return "\n".join(out) + "\n"


def to_csv(rows: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows({k: ("" if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()} for r in rows)
    return buf.getvalue()


def plot(points: list[Point], verdict: dict[str, Any], path: Path, save: Callable[[Any, Path], Path]) -> Path:
    """Left: measured final val loss against N (mean, error bar ±1 std over seeds) and each arm's fit; right:
    the fits' gap against N with its bootstrap interval, and the measured mean gap."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    colors = {"uniform": "tab:blue", "prism": "tab:orange"}
    rows = measured(points)
    sizes = np.array(sorted({m["N"] for m in rows}), dtype=float)
    grid = np.geomspace(sizes[0] / 1.3, sizes[-1] * 1.3, 100)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.4))
    for arm in fits.ARMS:
        mine = [m for m in rows if m["arm"] == arm]
        std = [0.0 if math.isnan(m["loss_std"]) else m["loss_std"] for m in mine]
        left.errorbar(
            [m["N"] for m in mine],
            [m["loss_mean"] for m in mine],
            yerr=std,
            fmt="o",
            capsize=3,
            color=colors[arm],
            label=f"{arm} measured (mean ± std over seeds)",
        )
        law = verdict["fits"][arm]
        curve = law.loss(grid) if law.beta is None else law.loss(grid, verdict["tokens_per_param"] * grid)
        left.plot(grid, curve, color=colors[arm], label=f"{arm} fit {_law(law)}")
    left.set(xscale="log", xlabel="parameters N", ylabel="final validation loss (nats/token)")
    left.set_title(f"loss against size ({verdict['form']}, {verdict['tokens_per_param']:.3g} tokens/param)")
    left.legend(fontsize=7)
    r = verdict["rows"]
    n, gap = np.array([x["N"] for x in r]), np.array([x["gap"] for x in r])
    low, high = np.array([x["gap_low"] for x in r]), np.array([x["gap_high"] for x in r])
    right.errorbar(
        n,
        gap,
        yerr=np.nan_to_num([gap - low, high - gap]),
        fmt="o-",
        capsize=3,
        color="tab:green",
        label="fits' gap, 95 % bootstrap interval",
    )
    by = {(m["N"], m["arm"]): m["loss_mean"] for m in rows}
    seen = [s for s in sizes if (s, "uniform") in by and (s, "prism") in by]
    right.plot(
        seen, [by[(s, "prism")] - by[(s, "uniform")] for s in seen], "x", color="black", label="measured mean gap"
    )
    right.axhline(0.0, color="black", lw=0.8)
    right.set(xscale="log", xlabel="parameters N", ylabel="Δ loss, Prism − uniform (nats/token)")
    right.set_title("gap against size (below 0 = Prism better)")
    right.legend(fontsize=7)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    return save(fig, path)


def write_report(
    points: list[Point], out_dir: Path, title: str, save: Callable[[Any, Path], Path]
) -> tuple[str, list[Path], dict[str, Any]]:
    """Fit, then scaling.md, scaling.csv (one row per N), scaling_points.csv (one per run) and scaling.png
    (``save`` writes a matplotlib figure: compare's, so every PNG of the comparison is saved one way)."""
    verdict = fit(points)
    table = markdown(points, verdict, title)
    out_dir.mkdir(parents=True, exist_ok=True)
    texts = {
        "scaling.md": table,
        "scaling.csv": to_csv(verdict["rows"]),
        "scaling_points.csv": to_csv([asdict(p) for p in points]),
    }
    paths = [out_dir / name for name in texts]
    for path, text in zip(paths, texts.values(), strict=True):
        write_atomic(path, text)
    paths.append(plot(points, verdict, out_dir / "scaling.png", save))
    return table, paths, verdict


def compare_section(
    runs: list[RunSeries], tracking_uri: str, out_dir: Path, save: Callable[[Any, Path], Path]
) -> tuple[str, list[Path]]:
    """`prism compare` on an experiment holding several scales: the same report; a fit that cannot be made
    is one line in the comparison, not an error (the arms table stands on its own)."""
    try:
        table, paths, _ = write_report(points_of(runs, tracking_uri), out_dir, "the scales of this experiment", save)
    except ConfigError as e:
        return f"\nScaling: not fitted: {e}\n", []
    return "\n" + table, paths

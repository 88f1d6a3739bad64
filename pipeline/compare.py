"""The arms comparison: read an experiment's training runs from MLflow and tabulate uniform vs Prism.

Per (scale, arm): runs, final val loss mean ± std over seeds (sample std, ddof=1; "n/a" for one run),
Δ = mean(Prism) − mean(uniform), tokens and steps to first reach each val-loss milestone (mean ± std over the
runs that reached it, plus how many did not), mean tokens/s and the Prism/uniform ratio. Writes Markdown,
CSV and two PNGs per scale (val loss vs tokens with ±1 std seed bands; Δ val loss vs tokens on a common
token grid, the paper's Fig. 3a), and logs them as artifacts of a run tagged ``kind=comparison``.

A metric logged twice at one step (a resume replays steps after the last checkpoint) counts once: the
value with the latest timestamp wins. Never imports the training loop.
"""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.atomic import write_atomic
from pipeline.config import ConfigError
from pipeline.tracking import store

ARMS = ("uniform", "prism")


@dataclass
class RunSeries:
    run_id: str
    name: str
    arm: str
    scale: str
    seed: str
    status: str
    val: list[tuple[int, float, float]]  # (step, tokens, val loss), one entry per step
    tokens_per_sec: float  # mean of the logged tokens_per_sec values
    milestones: dict[float, tuple[float, float] | None] = field(default_factory=dict)  # x -> (tokens, step)

    @property
    def final_val_loss(self) -> float:
        return self.val[-1][2] if self.val else math.nan


def latest_per_step(history: list[Any]) -> dict[int, float]:
    """MLflow metric history -> {step: value}, keeping the latest-logged value of a repeated step."""
    best: dict[int, tuple[int, int, float]] = {}
    for order, m in enumerate(history):
        rank = (m.timestamp, order)
        if m.step not in best or rank >= best[m.step][:2]:
            best[m.step] = (m.timestamp, order, m.value)
    return {step: best[step][2] for step in sorted(best)}


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample std (ddof=1); std is nan for fewer than two values, both nan for none."""
    n = len(values)
    if n == 0:
        return math.nan, math.nan
    mean = sum(values) / n
    if n < 2:
        return mean, math.nan
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))


def _fmt(mean: float, std: float, digits: int = 4) -> str:
    if math.isnan(mean):
        return "—"
    s = "n/a" if math.isnan(std) else f"{std:.{digits}f}"
    return f"{mean:.{digits}f} ± {s}"


def _thresholds(params: dict[str, str], metric_keys: list[str]) -> list[float]:
    xs: set[float] = set()
    raw = params.get("tracking.milestones")
    if raw:
        try:
            xs.update(float(x) for x in json.loads(raw))
        except (ValueError, TypeError):
            pass
    for key in metric_keys:  # milestones logged by a run whose config listed others (tags, or metrics before)
        if key.startswith("milestone/val_") and key.endswith("_step"):
            xs.add(float(key[len("milestone/val_") : -len("_step")]))
    return sorted(xs, reverse=True)


def load_runs(experiment: str, tracking_uri: str) -> list[RunSeries]:
    client = store.client(tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        names = [e.name for e in client.search_experiments()]
        raise ConfigError(
            f"experiment {experiment!r} not found in {tracking_uri}; it has: {', '.join(names) or 'none'}"
        )
    runs: list[RunSeries] = []
    for run in client.search_runs([exp.experiment_id], filter_string="tags.kind = 'train'", max_results=10000):
        tags, params = run.data.tags, run.data.params
        if tags.get("arm") not in ARMS:
            continue
        rid = run.info.run_id
        val = latest_per_step(client.get_metric_history(rid, "val/loss"))
        tokens = latest_per_step(client.get_metric_history(rid, "tokens_seen"))
        batch_tokens = float(params.get("train.batch_tokens", "nan"))
        series = [(s, tokens.get(s, s * batch_tokens), v) for s, v in val.items()]
        tps = list(latest_per_step(client.get_metric_history(rid, "tokens_per_sec")).values())
        milestones: dict[float, tuple[float, float] | None] = {}
        for x in _thresholds(params, [*run.data.metrics, *tags]):
            tok_key, step_key = f"milestone/val_{x!r}_tokens", f"milestone/val_{x!r}_step"
            if tok_key in tags and step_key in tags:  # how runs log milestones now
                milestones[x] = (float(tags[tok_key]), float(tags[step_key]))
                continue
            tok = latest_per_step(client.get_metric_history(rid, tok_key))  # runs logged before: metrics
            stp = latest_per_step(client.get_metric_history(rid, step_key))
            milestones[x] = (min(tok.values()), min(stp.values())) if tok and stp else None
        runs.append(
            RunSeries(
                rid,
                run.info.run_name,
                tags["arm"],
                tags.get("scale", "?"),
                tags.get("seed", "?"),
                run.info.status,
                series,
                mean_std(tps)[0],
                milestones,
            )
        )
    if not runs:
        raise ConfigError(f"experiment {experiment!r} in {tracking_uri} has no training runs (tags.kind='train')")
    return sorted(runs, key=lambda r: (r.scale, ARMS.index(r.arm), r.seed))


def summarize(runs: list[RunSeries]) -> list[dict[str, Any]]:
    """One row per (scale, arm) with every number of the report (nan where undefined)."""
    rows: list[dict[str, Any]] = []
    for scale in sorted({r.scale for r in runs}):
        groups = {arm: [r for r in runs if r.scale == scale and r.arm == arm] for arm in ARMS}
        finals = {arm: mean_std([r.final_val_loss for r in g]) for arm, g in groups.items()}
        speed = {arm: mean_std([r.tokens_per_sec for r in g])[0] for arm, g in groups.items()}
        for arm in ARMS:
            group = groups[arm]
            if not group:
                continue
            row: dict[str, Any] = {
                "scale": scale,
                "arm": arm,
                "runs": len(group),
                "seeds": ",".join(r.seed for r in group),
                "final_val_loss_mean": finals[arm][0],
                "final_val_loss_std": finals[arm][1],
                "delta_vs_uniform": finals[arm][0] - finals["uniform"][0] if arm == "prism" else math.nan,
                "tokens_per_sec_mean": speed[arm],
                "tokens_per_sec_ratio": speed[arm] / speed["uniform"]
                if arm == "prism" and speed["uniform"]
                else math.nan,
            }
            thresholds = sorted({x for r in group for x in r.milestones}, reverse=True)
            for x in thresholds:
                hit = [r.milestones[x] for r in group if r.milestones.get(x)]
                row[f"val_{x!r}_tokens_mean"], row[f"val_{x!r}_tokens_std"] = mean_std([h[0] for h in hit])
                row[f"val_{x!r}_steps_mean"], row[f"val_{x!r}_steps_std"] = mean_std([h[1] for h in hit])
                row[f"val_{x!r}_not_reached"] = len(group) - len(hit)
            rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]], experiment: str) -> str:
    out = [
        f"## Arms comparison: {experiment}",
        "",
        "| scale | arm | runs | final val loss (mean ± std) | Δ Prism − uniform | tokens/s | tokens/s ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        delta = "" if math.isnan(r["delta_vs_uniform"]) else f"{r['delta_vs_uniform']:+.4f}"
        ratio = "" if math.isnan(r["tokens_per_sec_ratio"]) else f"{r['tokens_per_sec_ratio']:.3f}"
        out.append(
            f"| {r['scale']} | {r['arm']} | {r['runs']} | {_fmt(r['final_val_loss_mean'], r['final_val_loss_std'])} "
            f"| {delta} | {r['tokens_per_sec_mean']:.0f} | {ratio} |"
        )
    out += [
        "",
        "Tokens (and steps) to first reach each validation-loss milestone (mean ± std over the runs that reached it):",
        "",
        "| scale | arm | val loss ≤ | tokens | steps | not reached |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        for key in [k for k in r if k.endswith("_not_reached")]:
            x = key[len("val_") : -len("_not_reached")]
            out.append(
                f"| {r['scale']} | {r['arm']} | {x} | {_fmt(r[f'val_{x}_tokens_mean'], r[f'val_{x}_tokens_std'], 0)} "
                f"| {_fmt(r[f'val_{x}_steps_mean'], r[f'val_{x}_steps_std'], 1)} | {r[key]} of {r['runs']} |"
            )
    return "\n".join(out) + "\n"


def to_csv(rows: list[dict[str, Any]]) -> str:
    columns: list[str] = []
    for r in rows:
        columns += [k for k in r if k not in columns]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for r in rows:
        writer.writerow({k: ("" if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()})
    return buf.getvalue()


def token_grid(runs: list[RunSeries], points: int = 200) -> list[float]:
    """Tokens where every run has a val loss on both sides: the overlap of all runs' ranges."""
    lo = max(r.val[0][1] for r in runs)
    hi = min(r.val[-1][1] for r in runs)
    if hi < lo:
        return []
    if hi == lo:
        return [lo]
    return [lo + (hi - lo) * i / (points - 1) for i in range(points)]


def interpolate(run: RunSeries, grid: list[float]) -> list[float]:
    import numpy as np

    tokens = [t for _, t, _ in run.val]
    losses = [v for _, _, v in run.val]
    return list(np.interp(grid, tokens, losses))


def plot(runs: list[RunSeries], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    paths: list[Path] = []
    colors = {"uniform": "tab:blue", "prism": "tab:orange"}
    for scale in sorted({r.scale for r in runs}):
        scale_runs = [r for r in runs if r.scale == scale and r.val]
        grid = token_grid(scale_runs) if scale_runs else []
        if not grid:
            continue
        means = {}
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for arm in ARMS:
            group = [r for r in scale_runs if r.arm == arm]
            if not group:
                continue
            curves = np.array([interpolate(r, grid) for r in group])
            mean = curves.mean(axis=0)
            means[arm] = mean
            ax.plot(grid, mean, color=colors[arm], label=f"{arm} (n={len(group)})")
            if len(group) > 1:
                std = curves.std(axis=0, ddof=1)
                ax.fill_between(grid, mean - std, mean + std, color=colors[arm], alpha=0.25)
        ax.set(
            xlabel="tokens",
            ylabel="validation loss",
            title=f"{scale}: val loss vs tokens (mean ± std over seeds)",
        )
        ax.legend()
        ax.grid(alpha=0.3)
        paths.append(_save(fig, out_dir / f"val_loss_vs_tokens_{scale}.png"))
        if len(means) == 2:
            fig, ax = plt.subplots(figsize=(6.4, 4.2))
            ax.plot(grid, means["prism"] - means["uniform"], color="tab:green")
            ax.axhline(0.0, color="black", lw=0.8)
            ax.set(xlabel="tokens", ylabel="Δ val loss (Prism − uniform)", title=f"{scale}: Δ val loss vs tokens")
            ax.grid(alpha=0.3)
            paths.append(_save(fig, out_dir / f"delta_val_loss_vs_tokens_{scale}.png"))
    return paths


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    tmp = path.with_name(path.stem + ".tmp.png")
    fig.tight_layout()
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
    return path


def _write(path: Path, text: str) -> Path:
    write_atomic(path, text)
    return path


def comparison_experiment(experiment: str) -> str:
    """The experiment holding the comparison run of ``experiment``: its own, so the comparison is not one more
    line in every chart legend of the arms' runs."""
    return f"{experiment}-comparison"


def log_comparison(experiment: str, tracking_uri: str, paths: list[Path], runs: list[RunSeries]) -> str:
    """Artifacts onto the one `kind=comparison` run of ``comparison_experiment(experiment)`` (reused later)."""
    from mlflow.entities import RunTag

    client = store.client(tracking_uri)
    arms_exp = client.get_experiment_by_name(experiment)
    name = comparison_experiment(experiment)
    exp = client.get_experiment_by_name(name)
    if exp is None:
        client.create_experiment(
            name, artifact_location=store.artifact_location(tracking_uri), tags={"compares": experiment}
        )
        exp = client.get_experiment_by_name(name)
    found = client.search_runs([exp.experiment_id], filter_string="tags.kind = 'comparison'", max_results=1)
    if found:
        run_id = found[0].info.run_id
        client.update_run(run_id, status="RUNNING")
    else:
        tags = {
            "kind": "comparison",
            "compared_experiment": experiment,
            "mlflow.note.content": f"Prism vs uniform over the training runs of experiment {experiment!r} "
            f"(id {arms_exp.experiment_id}); tables and plots under Artifacts > comparison.",
        }
        run_id = client.create_run(exp.experiment_id, run_name=f"comparison of {experiment}", tags=tags).info.run_id
    client.log_batch(run_id, tags=[RunTag("compared_runs", ",".join(r.run_id for r in runs)[:5000])])
    for p in paths:
        client.log_artifact(run_id, str(p), "comparison")
    client.set_terminated(run_id)
    return run_id


def compare_arms(experiment: str, tracking_uri: str, out_dir: str | Path, log_to_mlflow: bool = True) -> dict[str, Any]:
    """Load the experiment's training runs, write the report into ``out_dir`` and (optionally) log it."""
    runs = load_runs(experiment, tracking_uri)
    rows = summarize(runs)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = markdown(rows, experiment)
    paths = [_write(out / "comparison.md", table), _write(out / "comparison.csv", to_csv(rows))]
    paths += plot(runs, out)
    run_id = log_comparison(experiment, tracking_uri, paths, runs) if log_to_mlflow else None
    return {"table": table, "rows": rows, "runs": runs, "paths": paths, "comparison_run_id": run_id}

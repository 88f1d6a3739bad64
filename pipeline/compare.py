"""The arms comparison: read an experiment's training runs from MLflow and tabulate uniform vs Prism.

Per (scale, arm, schedule): runs, final val loss mean ± std over seeds (sample std, ddof=1; "n/a" for one
run); for each Prism schedule Δ = Prism − uniform with a 95 % CI and two-sided p-value (paired by seed when
both ran the same seeds on the same data order, Welch otherwise; pipeline.statistics) and the seeds that
effect and noise would need for 80 % power; tokens and steps to first reach each val-loss milestone (mean ±
std over the runs that reached it, plus how many did not); run tokens/s = tokens after the first step over the
wall time from the first to the last logged step, with a note when runs overlapped in time on one host
(they shared its cores, so their speeds are not comparable). Writes Markdown,
CSV and two PNGs per scale (val loss vs tokens with ±1 std seed bands; Δ val loss vs tokens on a common
token grid, the paper's Fig. 3a), plus downstream accuracy against tokens when the runs logged eval/* scores
(pipeline.eval.comparison: its table section, CSV and PNG), and logs them as artifacts of a run tagged
``kind=comparison``.

A metric logged twice at one step (a resume replays steps after the last checkpoint) counts once: the
value with the latest timestamp wins. Never imports the training loop.

Why it is over 400 lines: it is one job, read -> summarize -> table/CSV -> plots -> log, each stage a few
short functions over the same RunSeries, and every caller of the comparison (`prism compare`, study, demo,
search) wants the whole chain through `compare_arms`; split up, the stages would only pass RunSeries across
files. The downstream-eval part, a table section and plot of its own, is already pipeline.eval.comparison; the
scaling fits are pipeline.verdict.scaling's, which `compare_scales` runs over several experiments (`prism
scaling`) through the same read and log.
"""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline import statistics
from pipeline.atomic import write_atomic
from pipeline.config import ConfigError
from pipeline.config.resume_keys import DATA_ORDER_KEYS
from pipeline.eval import comparison as compare_evals
from pipeline.tracking import store
from pipeline.verdict.paired import seed_pairs

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
    run_tokens_per_sec: float  # tokens after the first logged step / wall time from it to the last logged step
    milestones: dict[float, tuple[float, float] | None] = field(default_factory=dict)  # x -> (tokens, step)
    schedule: str = ""  # compact head schedule, e.g. 3x2,6x2,12x4
    data_order: str = ""  # what fixes the batch sequence besides the seed: same value + same seed = pairable
    host: str = ""
    span: tuple[float, float] = (math.nan, math.nan)  # wall-clock seconds (first, last) of the logged steps
    evals: dict[str, list[tuple[int, float, float]]] = field(default_factory=dict)  # task/metric -> (step, tokens, v)
    branch_step: int | None = None  # a cooldown branch's step in its main run (pipeline.cooldown); None: a main run

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


# The logged params that, with the seed, fix which batches a run sees in which order: the config's data-order
# keys and the DP size the trainer logs as parallel/dp_size (the size the run started at).
DATA_ORDER_PARAMS = (*DATA_ORDER_KEYS, "parallel/dp_size")


def data_order(params: dict[str, str]) -> str:
    """What a run's logged params say about its batch sequence: equal strings and equal seeds pair two runs."""
    return "|".join(params.get(k, "?") for k in DATA_ORDER_PARAMS)


def throughput(history: list[Any]) -> tuple[float, tuple[float, float]]:
    """train/tokens_seen history -> (run tokens/s after the first logged step, (first, last) timestamp in seconds).

    The first step is left out (it carries graph building and warm-up); validation and checkpoint time
    between logged steps stay in: this is what a run really takes per token. A gap between two logged
    steps that is over 5x slower per token than the median gap is a stop and resume (or a stall), not
    training: it counts neither its tokens nor its time."""
    by_step: dict[int, Any] = {}
    for m in history:
        if m.step not in by_step or m.timestamp >= by_step[m.step].timestamp:
            by_step[m.step] = m
    points = [by_step[s] for s in sorted(by_step)]
    gaps = [(b.value - a.value, (b.timestamp - a.timestamp) / 1000.0) for a, b in zip(points, points[1:])]
    gaps = [(tokens, sec) for tokens, sec in gaps if tokens > 0 and sec > 0]
    if not gaps:
        return math.nan, (math.nan, math.nan)
    per_token = sorted(sec / tokens for tokens, sec in gaps)
    limit = 5 * per_token[len(per_token) // 2]
    kept = [(tokens, sec) for tokens, sec in gaps if sec / tokens <= limit]
    rate = sum(t for t, _ in kept) / sum(s for _, s in kept)
    return rate, (points[0].timestamp / 1000.0, points[-1].timestamp / 1000.0)


def _fmt(mean: float, std: float, digits: int = 4) -> str:
    if math.isnan(mean):
        return "—"
    s = "n/a" if math.isnan(std) else f"{std:.{digits}f}"
    return f"{mean:.{digits}f} ± {s}"


def _thresholds(params: dict[str, str], tag_keys: list[str]) -> list[float]:
    xs: set[float] = set()
    raw = params.get("tracking.milestones")
    if raw:
        try:
            xs.update(float(x) for x in json.loads(raw))
        except (ValueError, TypeError):
            pass
    for key in tag_keys:  # milestones logged by a run whose config listed others
        if key.startswith("milestone/val_") and key.endswith("_step"):
            xs.add(float(key[len("milestone/val_") : -len("_step")]))
    return sorted(xs, reverse=True)


def load_runs(experiment: str, tracking_uri: str, branches: bool = False) -> list[RunSeries]:
    """The experiment's main training runs, or with ``branches`` its cooldown branches only (annealed points,
    pipeline.verdict.annealed): a branch is never part of the main curves and tables."""
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
        if tags.get("arm") not in ARMS or ("branch_step" in tags) != branches:
            continue
        rid = run.info.run_id
        val = latest_per_step(client.get_metric_history(rid, "val/loss"))
        tokens_history = client.get_metric_history(rid, "train/tokens_seen")
        tokens = latest_per_step(tokens_history)
        batch_tokens = float(params.get("train.batch_tokens", "nan"))
        series = [(s, tokens.get(s, s * batch_tokens), v) for s, v in val.items()]
        tps, span = throughput(tokens_history)
        evals = {  # zero-shot scores, at the tokens of their step
            key.removeprefix("eval/"): [
                (s, tokens.get(s, s * batch_tokens), v)
                for s, v in latest_per_step(client.get_metric_history(rid, key)).items()
            ]
            for key in run.data.metrics
            if key.startswith("eval/")
        }
        milestones: dict[float, tuple[float, float] | None] = {}
        for x in _thresholds(params, list(tags)):
            tok_key, step_key = f"milestone/val_{x!r}_tokens", f"milestone/val_{x!r}_step"
            reached = tok_key in tags and step_key in tags
            milestones[x] = (float(tags[tok_key]), float(tags[step_key])) if reached else None
        runs.append(
            RunSeries(
                rid,
                run.info.run_name,
                tags["arm"],
                tags.get("scale", "?"),
                tags.get("seed", "?"),
                run.info.status,
                series,
                tps,
                milestones,
                schedule=tags.get("schedule", ""),
                data_order=data_order(params),
                host=tags.get("hostname", ""),
                span=span,
                evals=evals,
                branch_step=int(tags["branch_step"]) if branches else None,
            )
        )
    if not runs and not branches:
        raise ConfigError(f"experiment {experiment!r} in {tracking_uri} has no training runs (tags.kind='train')")
    return sorted(runs, key=lambda r: (r.scale, ARMS.index(r.arm), r.schedule, r.seed))


def arm_difference(uniform: list[RunSeries], prism: list[RunSeries]) -> statistics.Difference:
    """Prism − uniform final val loss: paired over the seeds both ran when they shared the data order
    (at least two such pairs), Welch's test over all runs otherwise."""
    pairs = seed_pairs(uniform, prism)
    if len(pairs) >= 2 and len(pairs) == len(uniform) == len(prism):
        return statistics.paired_difference([a.final_val_loss for a, _ in pairs], [b.final_val_loss for _, b in pairs])
    return statistics.welch_difference([r.final_val_loss for r in uniform], [r.final_val_loss for r in prism])


def seeds_for(diff: statistics.Difference, uniform: list[RunSeries], prism: list[RunSeries]) -> int | None:
    """Seeds per arm this effect and this noise need for a 5 %-level test with 80 % power."""
    if not diff.defined:
        return None
    if diff.method == "paired":
        return statistics.seeds_needed(diff.mean, diff.se * math.sqrt(diff.n), paired=True)
    (_, su), (_, sp) = (
        statistics.mean_std([r.final_val_loss for r in uniform]),
        statistics.mean_std([r.final_val_loss for r in prism]),
    )
    return statistics.seeds_needed(diff.mean, math.sqrt((su * su + sp * sp) / 2), paired=False)


def shared_machine(runs: list[RunSeries]) -> list[str]:
    """Names of runs that overlapped in time with another run on the same host."""
    busy: set[str] = set()
    for i, a in enumerate(runs):
        for b in runs[i + 1 :]:
            if a.host and a.host == b.host and a.span[0] < b.span[1] and b.span[0] < a.span[1]:
                busy.update((a.name, b.name))
    return sorted(busy)


def summarize(runs: list[RunSeries]) -> list[dict[str, Any]]:
    """One row per (scale, arm, schedule) with every number of the report (nan where undefined)."""
    rows: list[dict[str, Any]] = []
    for scale in sorted({r.scale for r in runs}):
        at_scale = [r for r in runs if r.scale == scale]
        uniform = [r for r in at_scale if r.arm == "uniform"]
        groups = [("uniform", uniform)] if uniform else []
        for sched in sorted({r.schedule for r in at_scale if r.arm == "prism"}):
            groups.append(("prism", [r for r in at_scale if r.arm == "prism" and r.schedule == sched]))
        uniform_speed = statistics.mean_std([r.run_tokens_per_sec for r in uniform])[0]
        for arm, group in groups:
            final_mean, final_std = statistics.mean_std([r.final_val_loss for r in group])
            speed = statistics.mean_std([r.run_tokens_per_sec for r in group])[0]
            diff = arm_difference(uniform, group) if arm == "prism" and uniform else None
            needed = seeds_for(diff, uniform, group) if diff else None
            row: dict[str, Any] = {
                "scale": scale,
                "arm": arm,
                "schedule": group[0].schedule,
                "runs": len(group),
                "seeds": ",".join(r.seed for r in group),
                "final_val_loss_mean": final_mean,
                "final_val_loss_std": final_std,
                **statistics.difference_columns(diff),
                "seeds_needed_80pct_power": "" if needed is None else needed,
                "run_tokens_per_sec_mean": speed,
                "run_tokens_per_sec_ratio": speed / uniform_speed if arm == "prism" and uniform_speed else math.nan,
            }
            thresholds = sorted({x for r in group for x in r.milestones}, reverse=True)
            for x in thresholds:
                hit = [r.milestones[x] for r in group if r.milestones.get(x)]
                row[f"val_{x!r}_tokens_mean"], row[f"val_{x!r}_tokens_std"] = statistics.mean_std([h[0] for h in hit])
                row[f"val_{x!r}_steps_mean"], row[f"val_{x!r}_steps_std"] = statistics.mean_std([h[1] for h in hit])
                row[f"val_{x!r}_not_reached"] = len(group) - len(hit)
            rows.append(row)
    return rows


def _needed_cell(r: dict[str, Any]) -> str:
    n = r["seeds_needed_80pct_power"]
    if n == "":
        return ""
    return f"> {n - 1}" if n > 1000 else str(n)


def markdown(rows: list[dict[str, Any]], experiment: str, busy: list[str] | None = None) -> str:
    out = [
        f"## Arms comparison: {experiment}",
        "",
        "| scale | arm | schedule | seeds | final val loss (mean ± std) | Δ Prism − uniform [95 % CI] | p (test) "
        "| seeds for 80 % power | run tokens/s | run tokens/s ratio |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        delta, p = statistics.difference_cells(r)
        ratio = "" if math.isnan(r["run_tokens_per_sec_ratio"]) else f"{r['run_tokens_per_sec_ratio']:.3f}"
        out.append(
            f"| {r['scale']} | {r['arm']} | {r['schedule']} | {r['runs']} "
            f"| {_fmt(r['final_val_loss_mean'], r['final_val_loss_std'])} | {delta} | {p} | {_needed_cell(r)} "
            f"| {r['run_tokens_per_sec_mean']:.0f} | {ratio} |"
        )
    out += [
        "",
        "Val loss in nats per token; std = sample std over seeds. Δ < 0: Prism better. The test is paired by "
        "seed when both arms ran the same seeds on the same data order, Welch's otherwise; \"seeds for 80 % "
        'power" = seeds per arm a two-sided 5 % test needs to detect the observed Δ given the observed noise.',
        "run tokens/s = tokens after the first step / wall time from the first to the last logged step "
        "(validation and checkpoints included; a step line's train tok/s leaves them out).",
    ]
    if busy:
        out.append(
            f"Note: runs {', '.join(busy)} overlapped in time on one machine and shared its cores: "
            "their run tokens/s (and the ratio) measure the contention, not the arms."
        )
    out += [
        "",
        "Tokens (and steps) to first reach each validation-loss milestone (mean ± std over the runs that reached it):",
        "",
        "| scale | arm | schedule | val loss ≤ | tokens | steps | not reached |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for key in [k for k in r if k.endswith("_not_reached")]:
            x = key[len("val_") : -len("_not_reached")]
            out.append(
                f"| {r['scale']} | {r['arm']} | {r['schedule']} | {x} "
                f"| {_fmt(r[f'val_{x}_tokens_mean'], r[f'val_{x}_tokens_std'], 0)} "
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


def compact_tokens(x: float, _pos: Any = None) -> str:
    """Axis label for a token count: 0, 950, 200k, 1.5M, 2.9B."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{suffix}"
    return f"{x:.0f}"


def _series_label(arm: str, schedule: str) -> str:
    return arm if arm == "uniform" else f"prism {schedule}"


def plot(runs: list[RunSeries], out_dir: Path) -> list[Path]:
    """Per scale: val loss vs tokens (mean line, ±1 std band over seeds, a marker at every measured point)
    and Δ val loss vs tokens per Prism schedule, on the tokens where the uniform arm measured val loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.ticker import FuncFormatter

    paths: list[Path] = []
    palette = ["tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive"]
    for scale in sorted({r.scale for r in runs}):
        scale_runs = [r for r in runs if r.scale == scale and r.val]
        grid = token_grid(scale_runs) if scale_runs else []
        if not grid:
            continue
        keys = sorted({(r.arm, r.schedule) for r in scale_runs}, key=lambda k: (ARMS.index(k[0]), k[1]))
        colors = {k: "tab:blue" if k[0] == "uniform" else palette[i % len(palette)] for i, k in enumerate(keys)}
        groups = {k: [r for r in scale_runs if (r.arm, r.schedule) == k] for k in keys}
        fig, ax = plt.subplots(figsize=(6.8, 4.4))
        for key, group in groups.items():
            curves = np.array([interpolate(r, grid) for r in group])
            mean = curves.mean(axis=0)
            ax.plot(grid, mean, color=colors[key], label=f"{_series_label(*key)} (n={len(group)})")
            for r in group:  # the measured points themselves: the line between them is interpolation
                ax.plot([t for _, t, _ in r.val], [v for _, _, v in r.val], "o", ms=3, color=colors[key], alpha=0.6)
            if len(group) > 1:
                std = curves.std(axis=0, ddof=1)
                ax.fill_between(grid, mean - std, mean + std, color=colors[key], alpha=0.2, lw=0)
        ax.set(xlabel="training tokens", ylabel="validation loss (nats/token)")
        ax.set_title(f"{scale}: validation loss vs tokens\nline: mean over seeds, band: ±1 std, dots: measured")
        ax.xaxis.set_major_formatter(FuncFormatter(compact_tokens))
        ax.legend()
        ax.grid(alpha=0.3)
        paths.append(_save(fig, out_dir / f"val_loss_vs_tokens_{scale}.png"))
        uniform = groups.get(("uniform", next((k[1] for k in keys if k[0] == "uniform"), "")))
        prism_keys = [k for k in keys if k[0] == "prism"]
        if uniform and prism_keys:
            lo, hi = grid[0], grid[-1]
            points = sorted({t for r in uniform for _, t, _ in r.val if lo <= t <= hi}) or grid
            base = np.array([interpolate(r, points) for r in uniform]).mean(axis=0)
            fig, ax = plt.subplots(figsize=(6.8, 4.4))
            for key in prism_keys:
                curves = np.array([interpolate(r, points) for r in groups[key]])
                delta = curves.mean(axis=0) - base
                ax.plot(points, delta, "o-", ms=4, color=colors[key], label=f"{_series_label(*key)}")
            ax.axhline(0.0, color="black", lw=0.8)
            ax.set(xlabel="training tokens", ylabel="Δ val loss, Prism − uniform (nats/token)")
            ax.set_title(f"{scale}: Δ validation loss vs tokens (mean over seeds)\nbelow 0 = Prism better")
            ax.xaxis.set_major_formatter(FuncFormatter(compact_tokens))
            ax.legend()
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


def comparison_experiment(experiment: str) -> str:
    """The experiment holding the comparison run of ``experiment``: its own, so the comparison is not one more
    line in every chart legend of the arms' runs."""
    return f"{experiment}-comparison"


def log_comparison(experiment: str, tracking_uri: str, paths: list[Path], runs: list[RunSeries]) -> str:
    """Artifacts onto the one `kind=comparison` run of ``comparison_experiment(experiment)`` (reused later)."""
    from mlflow.entities import RunTag

    client = store.client(tracking_uri)
    arms_exp = client.get_experiment_by_name(experiment)  # None for several (prism scaling: "a+b+c")
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
            f"(id {arms_exp.experiment_id if arms_exp else 'several'}); tables and plots under Artifacts > comparison.",
        }
        run_id = client.create_run(exp.experiment_id, run_name=f"comparison of {experiment}", tags=tags).info.run_id
    client.log_batch(run_id, tags=[RunTag("compared_runs", ",".join(r.run_id for r in runs)[:5000])])
    for p in paths:
        client.log_artifact(run_id, str(p), "comparison")
    client.set_terminated(run_id)
    return run_id


def compare_scales(
    experiments: list[str], tracking_uri: str, out_dir: str | Path, log_to_mlflow: bool = True
) -> dict[str, Any]:
    """`prism scaling`: the finished runs of several experiments (one per scale) through pipeline.verdict.scaling,
    logged to the comparison run of all of them, named "a+b+c" (comparison_experiment of that)."""
    from pipeline.verdict import scaling

    experiments = list(dict.fromkeys(experiments))
    runs: list[RunSeries] = []
    for experiment in experiments:
        found = load_runs(experiment, tracking_uri)
        scaling.check_finished(experiment, found)
        runs += found + load_runs(experiment, tracking_uri, branches=True)  # cooldown branches: more (N, D)
    points = scaling.points_of(runs, tracking_uri)
    table, paths, verdict = scaling.write_report(points, Path(out_dir), ", ".join(experiments), _save)
    label, used = "+".join(experiments), {p.run_id for p in points}
    used_runs = [r for r in runs if r.run_id in used]
    run_id = log_comparison(label, tracking_uri, paths, used_runs) if log_to_mlflow else None
    return {
        "table": table,
        "paths": paths,
        "verdict": verdict,
        "comparison_run_id": run_id,
        "comparison_experiment": comparison_experiment(label),
    }


def compare_arms(experiment: str, tracking_uri: str, out_dir: str | Path, log_to_mlflow: bool = True) -> dict[str, Any]:
    """Load the experiment's training runs, write the report into ``out_dir`` and (optionally) log it."""
    every = load_runs(experiment, tracking_uri)
    # A run still going (or stopped) has no final val loss yet: it would pull the means toward early losses.
    runs = [r for r in every if r.status == "FINISHED"] or every
    unfinished = sorted(r.name for r in every if r not in runs)
    rows = summarize(runs)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = markdown(rows, experiment, shared_machine(runs))
    if unfinished:
        table += f"\nLeft out, not FINISHED (running, stopped or failed): {', '.join(unfinished)}\n"
    accuracy = compare_evals.summarize(runs)
    table += compare_evals.markdown(accuracy)
    branches = load_runs(experiment, tracking_uri, True)
    scaling_paths: list[Path] = []
    if len({r.scale for r in runs}) > 1:  # several sizes in one experiment: the scaling fits too
        from pipeline.verdict import scaling

        text, scaling_paths = scaling.compare_section(runs + branches, tracking_uri, out, _save)
        table += text
    from pipeline.verdict import paired  # the item- and sequence-paired tables, from the runs' artifacts

    paired_text, paired_csvs = paired.section(runs, rows, tracking_uri)
    table += paired_text
    from pipeline.verdict import annealed  # cooldown branches: annealed loss at each budget

    annealed_text, annealed_paths = annealed.section(branches, runs, out, _save, arm_difference, tracking_uri)
    table += annealed_text
    texts = {"comparison.md": table, "comparison.csv": to_csv(rows)}
    if accuracy:
        texts["accuracy_vs_tokens.csv"] = compare_evals.to_csv(accuracy)
    texts.update(paired_csvs)
    paths = [out / name for name in texts]
    for path, text in zip(paths, texts.values(), strict=True):
        write_atomic(path, text)
    paths += plot(runs, out) + scaling_paths + annealed_paths
    paths += compare_evals.plot(accuracy, out, _save, compact_tokens) if accuracy else []
    run_id = log_comparison(experiment, tracking_uri, paths, runs) if log_to_mlflow else None
    return {
        "table": table,
        "rows": rows,
        "accuracy": accuracy,
        "runs": runs,
        "paths": paths,
        "comparison_run_id": run_id,
        "comparison_experiment": comparison_experiment(experiment),
    }

"""What the search shows and keeps: the console's one-line summary, the MLflow parent run with the trials as
its children, and the results (a markdown and CSV table, a plot of val loss per trial) logged to it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from pipeline.atomic import write_atomic
from pipeline.console import duration
from pipeline.runs.outcome import tokens_trained, val_losses
from pipeline.search.spec import SearchSpec


def summary(spec: SearchSpec, state: Any, t0: float) -> str:
    trials = [r for r in state.runs.values() if r["kind"] == "trial"]
    count = {s: sum(r["status"] == s for r in trials) for s in ("running", "stopping", "pruned", "complete", "failed")}
    spent = sum(tokens_trained(r, spec.base.train.batch_tokens) for r in trials)
    grid = len(spec.schedules) * spec.rungs.full_tokens
    complete = [r for r in trials if r["status"] == "complete"]
    best = min(complete, key=lambda r: r["final_val"]) if complete else None
    best_text = (
        f"best {best['key']} {best['schedule']} val {best['final_val']:.4f}" if best else "best: none complete yet"
    )
    return (
        f"  -- {len(trials)}/{spec.trials} trials: {count['running'] + count['stopping']} running, "
        f"{count['pruned']} pruned, {count['complete']} complete, {count['failed']} failed | {best_text} | "
        f"tokens {spent:,} of the full grid's {grid:,} ({spent / grid:.1%}) [{duration(time.monotonic() - t0)}]"
    )


# --- MLflow: the parent run and its children -----------------------------------------------------------
def parent_run(spec: SearchSpec, state: Any, uri: str, say: Any) -> None:
    if state.data.get("parent_run_id"):
        return
    from pipeline.tracking import store
    from pipeline.tracking.journal import Delivery, Journal

    try:
        delivery = Delivery(uri, spec.name, Journal(spec.folder))
        run = store.client(uri).create_run(
            delivery.experiment_id(),
            run_name=f"search-{spec.name}",
            tags={"kind": "search", "search": spec.name, "spec": str(spec.path)},
        )
        state.data["parent_run_id"] = run.info.run_id
        state.save()
    except Exception as e:  # noqa: BLE001 - a search never stops for tracking
        say(f"  (MLflow parent run not created: {str(e).splitlines()[0][:160]}; trials still log)")


def child_run(spec: SearchSpec, state: Any, uri: str, rec: dict[str, Any], say: Any) -> None:
    """A trial's MLflow run, made before its `prism train` starts: a child of the search's parent run, named
    <search>-<trial> and tagged with the trial number. Its id goes into the trial's journal, so the trainer
    logs into it instead of making a run of its own. Without a parent run or a reachable store the trial
    logs as a run of its own (a search never stops for tracking)."""
    from pipeline.tracking import store
    from pipeline.tracking.journal import Delivery, Journal

    parent = state.data.get("parent_run_id")
    journal = Journal(rec["checkpoint_dir"])
    if not parent or journal.state()["run_id"] is not None:  # made already, by a driver killed before launch
        return
    try:
        run = store.client(uri).create_run(
            Delivery(uri, spec.name, journal).experiment_id(),
            run_name=f"{spec.name}-{rec['key']}",
            tags={"mlflow.parentRunId": parent, "search": spec.name, "search.trial": str(rec["trial"])},
        )
        journal.folder.mkdir(parents=True, exist_ok=True)
        journal.save_state(run_id=run.info.run_id)
    except Exception as e:  # noqa: BLE001 - a search never stops for tracking
        say(f"  ({rec['key']}: its MLflow run is not a child of the search's: {str(e).splitlines()[0][:160]})")


# --- results: table, plot, logged to the parent run ---------------------------------------------------
def results(spec: SearchSpec, state: Any, uri: str, say: Any) -> list[dict[str, Any]]:
    trials = sorted((r for r in state.runs.values() if r["kind"] == "trial"), key=lambda r: r["trial"])
    points = spec.rungs.points
    head = ["trial", "schedule", "lr", "state", "rungs reached", *[f"val @ {t:,}" for t in points], "tokens"]
    rows = []
    for r in trials:
        r["tokens"] = tokens_trained(r, spec.base.train.batch_tokens)
        vals = [r.get("rungs", {}).get(str(t)) for t in points[:-1]] + [r.get("final_val")]
        reached = sum(v is not None for v in vals)
        rows.append(
            [
                r["key"],
                r["schedule"],
                f"{r['lr']:.2e}" if r.get("lr") is not None else "base",
                r["status"],
                f"{reached}/{len(points)}",
                *[f"{v:.4f}" if v is not None else "" for v in vals],
                f"{r.get('tokens', 0):,}",
            ]
        )
    table = "\n".join(
        ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(row) + " |" for row in rows]
    )
    spent = sum(r.get("tokens", 0) for r in trials)
    grid = len(spec.schedules) * spec.rungs.full_tokens
    complete = [r for r in trials if r["status"] == "complete"]
    best = min(complete, key=lambda r: r["final_val"]) if complete else None
    text = (
        f"## Search {spec.name}\n\n{table}\n\n"
        f"Tokens trained: {spent:,} against {grid:,} for the full grid ({spent / grid:.1%}). "
        + (
            f"Best: {best['key']} {best['schedule']} (val {best['final_val']:.4f}).\n"
            if best
            else "No trial completed.\n"
        )
    )
    out = spec.folder
    write_atomic(out / "results.md", text)
    write_atomic(
        out / "results.csv", "\n".join(",".join(c.replace(",", ";") for c in row) for row in [head, *rows]) + "\n"
    )
    paths = [out / "results.md", out / "results.csv", plot(spec, uri, trials)]
    say(text)
    for p in paths:
        say(f"wrote {p}")
    log_results(spec, state, uri, say, paths, best, spent, grid)
    return complete


def plot(spec: SearchSpec, uri: str, trials: list[dict[str, Any]]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batch = spec.base.train.batch_tokens
    fig, ax = plt.subplots(figsize=(7, 4.4))
    for r in trials:
        values, _ = val_losses(r, uri)
        steps = sorted(values)
        style = "-" if r["status"] == "complete" else "--"
        ax.plot(
            [s * batch for s in steps],
            [values[s] for s in steps],
            style,
            marker="o",
            ms=3,
            label=f"{r['key']} {r['schedule']} ({r['status']})",
        )
    for t in spec.rungs.points:
        ax.axvline(t, color="grey", lw=0.6)
    ax.set(
        xlabel="training tokens",
        ylabel="validation loss (nats/token)",
        title=f"search {spec.name}: val loss per trial (grey: rungs)",
    )
    ax.legend(fontsize=6)
    ax.grid(alpha=0.3)
    path = spec.folder / "results.png"
    fig.tight_layout()
    tmp = path.with_name("results.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
    return path


def log_results(
    spec: SearchSpec,
    state: Any,
    uri: str,
    say: Any,
    paths: list[Path],
    best: dict[str, Any] | None,
    spent: int,
    grid: int,
) -> None:
    parent = state.data.get("parent_run_id")
    if not parent:
        return
    from pipeline.tracking import store

    try:
        client = store.client(uri)
        for p in paths:
            client.log_artifact(parent, str(p), "search")
        client.log_metric(parent, "search/tokens", spent)
        client.log_metric(parent, "search/grid_tokens", grid)
        if best:
            client.log_metric(parent, "search/best_val", best["final_val"])
            client.set_tag(parent, "best_schedule", best["schedule"])
        client.set_terminated(parent)
    except Exception as e:  # noqa: BLE001
        say(f"  (results not logged to MLflow: {str(e).splitlines()[0][:160]}; they are in {spec.folder})")

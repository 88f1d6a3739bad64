"""D_l of checkpoints (what `prism attention-distance` runs): measure each, ΔD_l between the arms, write
tables and plots, log them to each checkpoint's MLflow run."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

from pipeline.analysis import report
from pipeline.analysis.measure import count_sequences, delta_rows, iter_sequences, measure
from pipeline.config import ConfigError
from pipeline.tracking.store import log_to_run


def measure_checkpoint(
    path: str | Path, split: str, sequences: int, out_dir: Path | None, device: str, overrides: list[str]
) -> dict[str, Any]:
    """D_l of one checkpoint: writes <out>/<run>-<tag>.{csv,json,png}; returns the result with its files."""
    from pipeline.checkpoint import resolve_tag_dir
    from pipeline.inference import load_checkpoint, load_config

    data_dir = load_config(resolve_tag_dir(path), overrides).data.dataset_dir
    available = count_sequences(data_dir, split)  # refuse before loading a model
    if sequences > available:
        raise ConfigError(
            f"--sequences {sequences}: {data_dir} split {split!r} holds {available}; ask for at most {available}"
        )
    cfg, model, info = load_checkpoint(path, overrides, device)
    rows = measure(model, cfg, iter_sequences(cfg.data.dataset_dir, split), sequences)
    del model
    gc.collect()
    out = Path(out_dir) if out_dir else cfg.run_dir / "analysis"
    name = f"{cfg.run_name}-{info.tag_dir.name}"
    meta = {
        "checkpoint": str(info.tag_dir),
        "run_name": cfg.run_name,
        "arm": cfg.run.arm,
        "step": info.step,
        "split": split,
        "sequences": sequences,
        "seq_len": cfg.model.seq_len,
        "heads_per_layer": list(cfg.heads_per_layer),
        "query_window": "1-indexed floor(T/2)+1..T",
    }
    files = report.write_table(rows, report.COLUMNS, meta, out / f"attention-distance-{name}")
    files.append(
        report.plot_distance(
            {name: rows},
            out / f"attention-distance-{name}.png",
            f"Attention distance per layer: {name}\n{split} split, {sequences} sequences of {cfg.model.seq_len} tokens",
        )
    )
    return {"cfg": cfg, "info": info, "rows": rows, "name": name, "files": files, "meta": meta}


def delta_between_arms(main: list[dict[str, Any]], other: list[dict[str, Any]], out: Path) -> dict[str, Any]:
    """ΔD_l between the Prism and the uniform group (whichever side each is on)."""
    groups = {"prism": [], "uniform": []}
    for result in main + other:
        groups[result["cfg"].run.arm].append(result)
    if not groups["prism"] or not groups["uniform"]:
        raise ConfigError(
            "--compare needs Prism and uniform checkpoints (one side each, seeds allowed); "
            f"got arms {sorted({r['cfg'].run.arm for r in main + other})}"
        )
    rows = delta_rows([r["rows"] for r in groups["prism"]], [r["rows"] for r in groups["uniform"]])
    prism_heads = groups["prism"][0]["cfg"].heads_per_layer
    meta = {
        "prism": [r["name"] for r in groups["prism"]],
        "uniform": [r["name"] for r in groups["uniform"]],
        "prism_heads_per_layer": list(prism_heads),
        "split": main[0]["meta"]["split"],
        "sequences": main[0]["meta"]["sequences"],
        "definition": "delta = D_l(prism) - D_l(uniform)",
    }
    stem = out / "attention-distance-delta"
    files = report.write_table(rows, report.DELTA_COLUMNS, meta, stem)
    files.append(
        report.plot_delta(
            rows,
            prism_heads,
            stem.with_suffix(".png"),
            f"Attention distance, Prism − uniform, per layer "
            f"({len(groups['prism'])} Prism vs {len(groups['uniform'])} uniform checkpoints)",
        )
    )
    files.append(
        report.plot_distance(
            {r["name"]: r["rows"] for r in main + other},
            out / "attention-distance-all.png",
            "Attention distance per layer, every checkpoint",
        )
    )
    return {"rows": rows, "files": files, "meta": meta}


def measure_checkpoints(
    paths: list[str],
    compare_paths: list[str],
    split: str = "val",
    sequences: int = 16,
    out: str | Path | None = None,
    device: str = "auto",
    overrides: list[str] | None = None,
) -> dict[str, Any]:
    """D_l of every checkpoint in ``paths`` and ``compare_paths``, plus ΔD_l when ``compare_paths`` is given."""
    if sequences < 1:
        raise ConfigError(f"--sequences {sequences} must be >= 1")
    out_dir = Path(out) if out else None
    main = [measure_checkpoint(p, split, sequences, out_dir, device, overrides or []) for p in paths]
    other = [measure_checkpoint(p, split, sequences, out_dir, device, overrides or []) for p in compare_paths]
    result: dict[str, Any] = {"checkpoints": main + other}
    delta_files: list[Path] = []
    if other:
        delta = delta_between_arms(main, other, out_dir or main[0]["cfg"].run_dir / "analysis")
        result["delta"] = delta
        delta_files = delta["files"]
    for r in main + other:  # each run gets its own D_l files, and the comparison when there is one
        files = [("attention_distance", f) for f in r["files"] + delta_files]
        r["mlflow"] = log_to_run(r["cfg"], r["info"].run_id, {}, r["info"].step, files)
    return result

"""`prism attention-distance` on real checkpoints: Eq. 1 recomputed by hand from the model's own maps, the
Prism - uniform comparison, the MLflow artifacts, and the one-line refusals."""

from __future__ import annotations

import csv
import json

import pytest
import torch


def naive_eq1(probs: torch.Tensor) -> float:
    """Eq. 1 for one [h, T, T] map, written as the paper states it (1-indexed t and s, explicit sums)."""
    heads, seq_len, _ = probs.shape
    window = range(seq_len // 2 + 1, seq_len + 1)
    total = 0.0
    for head in range(heads):
        per_query = [sum(float(probs[head, t - 1, s - 1]) * abs(t - s) for s in range(1, t + 1)) for t in window]
        total += sum(per_query) / len(per_query)
    return total / heads


def read_csv(path):
    with open(path) as f:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]


def test_attention_distance_cli_matches_eq1_and_writes_the_comparison(tiny_checkpoints, tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    from pipeline import config, data
    from pipeline.cli import main
    from pipeline.inference import load_checkpoint
    from pipeline.model import capture_attention, logits

    n = 2
    args = [
        "attention-distance",
        str(tiny_checkpoints.prism),
        "--compare",
        str(tiny_checkpoints.uniform),
        "--split",
        "val",
        "--sequences",
        str(n),
        "--out",
        str(tmp_path),
    ]
    assert main(args) == 0
    assert "ΔD_l = D_l(Prism) - D_l(uniform)" in capsys.readouterr().out
    prism_rows = read_csv(tmp_path / "attention-distance-prism-tiny-s1234-step-0000002.csv")
    uniform_rows = read_csv(tmp_path / "attention-distance-uniform-tiny-s1234-step-0000002.csv")

    # The same numbers, recomputed independently: the trainer's own val reader, the model's hook, Eq. 1 by hand.
    cfg, model, _ = load_checkpoint(tiny_checkpoints.prism, device="cpu")
    val_cfg = config.from_dict(config.apply_overrides(cfg.to_dict(), [f"train.val_tokens={n * cfg.model.seq_len}"]))
    rows = data.load_val_tokens(val_cfg)
    assert rows.shape == (n, cfg.model.seq_len + 1)
    per_layer: dict[int, list[float]] = {}
    with torch.no_grad(), capture_attention(model) as maps:
        for row in rows:
            logits(model, torch.from_numpy(row[:-1].astype("int64"))[None])
            for layer, probs in maps.items():
                per_layer.setdefault(layer, []).append(naive_eq1(probs[0]))
    heads = cfg.heads_per_layer
    assert [int(r["heads"]) for r in prism_rows] == list(heads) and len(prism_rows) == cfg.model.num_layers
    assert [int(r["head_dim"]) for r in prism_rows] == [cfg.model.d_model // h for h in heads]
    assert all(int(r["sequences"]) == n for r in prism_rows)
    max_distance = sum(t - 1 for t in range(cfg.model.seq_len // 2 + 1, cfg.model.seq_len + 1)) / (
        cfg.model.seq_len - cfg.model.seq_len // 2
    )  # attend-to-first, the largest Eq. 1 allows
    for r in prism_rows:
        values = torch.tensor(per_layer[int(r["layer"])], dtype=torch.float64)
        assert r["D"] == pytest.approx(values.mean().item(), rel=1e-5)
        assert r["std"] == pytest.approx(values.std().item(), rel=1e-4, abs=1e-6)
        assert 0 < r["D"] < max_distance

    # ΔD_l per layer, from the two tables, plus the plots; everything logged to both runs.
    delta = json.loads((tmp_path / "attention-distance-delta.json").read_text())
    assert delta["prism_heads_per_layer"] == list(heads) and delta["split"] == "val"
    for d, p, u in zip(delta["layers"], prism_rows, uniform_rows):
        assert d["delta"] == pytest.approx(p["D"] - u["D"], rel=1e-6, abs=1e-9) and d["delta_se"] > 0
        assert (d["heads_prism"], d["heads_uniform"]) == (int(p["heads"]), int(u["heads"]))
    for png in (
        "attention-distance-delta.png",
        "attention-distance-all.png",
        "attention-distance-prism-tiny-s1234-step-0000002.png",
    ):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for arm in ("prism", "uniform"):
        client = MlflowClient(tiny_checkpoints.tracking_uri(arm))
        (run,) = client.search_runs([client.get_experiment_by_name("prism-tiny").experiment_id])
        logged = {a.path.split("/")[-1] for a in client.list_artifacts(run.info.run_id, "attention_distance")}
        assert {
            f"attention-distance-{arm}-tiny-s1234-step-0000002.csv",
            "attention-distance-delta.csv",
            "attention-distance-delta.png",
        } <= logged


def test_attention_distance_bad_input_is_one_line(tiny_checkpoints, tmp_path, capsys):
    from pipeline.cli import main

    assert main(["attention-distance", str(tiny_checkpoints.prism), "--sequences", "100000"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("prism attention-distance: error: --sequences 100000:") and "\n" not in err
    assert main(["attention-distance", str(tiny_checkpoints.prism), "--split", "test"]) == 2
    assert "--split test" in capsys.readouterr().err
    same_arm = [
        "attention-distance",
        str(tiny_checkpoints.prism),
        "--compare",
        str(tiny_checkpoints.prism),
        "--sequences",
        "1",
        "--out",
        str(tmp_path),
    ]
    assert main(same_arm) == 2
    assert "needs Prism and uniform checkpoints" in capsys.readouterr().err

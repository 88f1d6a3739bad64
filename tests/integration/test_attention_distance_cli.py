"""Eq. 1 (per-layer attention distance) on synthetic maps with known answers, then on a real checkpoint."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from pipeline.analysis.distance import DistanceAccumulator, head_distances, layer_distance, query_rows


def causal_uniform(seq_len: int, heads: int = 1) -> torch.Tensor:
    """Row t (1-indexed) spreads 1/t over keys 1..t."""
    mask = torch.tril(torch.ones(seq_len, seq_len, dtype=torch.float64))
    return (mask / mask.sum(-1, keepdim=True)).expand(heads, seq_len, seq_len)


def random_causal(seq_len: int, heads: int, generator: torch.Generator) -> torch.Tensor:
    scores = torch.randn(heads, seq_len, seq_len, generator=generator, dtype=torch.float64)
    causal = torch.tril(torch.ones(seq_len, seq_len, dtype=torch.bool))
    return scores.masked_fill(~causal, float("-inf")).softmax(-1)


def window_mean(seq_len: int, per_query) -> float:
    """Mean of per_query(t) over Eq. 1's window, 1-indexed t = floor(T/2)+1 .. T, written independently."""
    ts = list(range(seq_len // 2 + 1, seq_len + 1))
    return sum(per_query(t) for t in ts) / len(ts)


@pytest.mark.parametrize("seq_len", [8, 9, 64, 255])
def test_uniform_causal_attention_gives_half_the_offset(seq_len):
    d = layer_distance(causal_uniform(seq_len, heads=3))
    assert d.item() == pytest.approx(window_mean(seq_len, lambda t: (t - 1) / 2), rel=1e-12)


@pytest.mark.parametrize("seq_len", [8, 9, 64])
def test_attend_to_self_is_zero_and_attend_to_first_is_offset(seq_len):
    self_map = torch.eye(seq_len)[None]
    assert layer_distance(self_map).item() == 0.0
    first_map = torch.zeros(2, seq_len, seq_len)
    first_map[..., 0] = 1.0
    assert layer_distance(first_map).item() == pytest.approx(window_mean(seq_len, lambda t: t - 1), rel=1e-12)


def test_linear_in_the_map_so_head_average_gives_the_same_distance():
    g = torch.Generator().manual_seed(0)
    probs = random_causal(33, heads=6, generator=g)
    per_head = head_distances(probs)
    assert per_head.shape == (6,)
    assert per_head.std() > 0  # the heads really differ, so the check below means something
    averaged_map = probs.mean(0, keepdim=True)
    assert layer_distance(probs).item() == pytest.approx(layer_distance(averaged_map).item(), rel=1e-12)
    # and a mixture of maps has the mixture of distances
    other = random_causal(33, heads=6, generator=g)
    mix = 0.3 * probs + 0.7 * other
    assert layer_distance(mix).item() == pytest.approx(
        0.3 * layer_distance(probs).item() + 0.7 * layer_distance(other).item(), rel=1e-12
    )


def test_query_window_for_odd_context_length():
    # T = 7: 1-indexed queries 4..7 (0-indexed rows 3..6), |Q| = 4
    assert list(query_rows(7)) == [3, 4, 5, 6]
    assert list(query_rows(1024))[0] == 512 and len(query_rows(1024)) == 512
    # a map whose only long-range row is 1-indexed t = 3 (outside Q) must give 0 ...
    probs = torch.eye(7)[None].clone()
    probs[0, 2] = torch.tensor([1.0, 0, 0, 0, 0, 0, 0])
    assert layer_distance(probs).item() == 0.0
    # ... and the first row inside Q (t = 4, attending to s = 1: distance 3) counts with weight 1/4
    probs[0, 3] = torch.tensor([1.0, 0, 0, 0, 0, 0, 0])
    assert layer_distance(probs).item() == pytest.approx(3 / 4)


def test_accumulator_reports_mean_std_heads_and_head_dim():
    acc = DistanceAccumulator([1, 2], d_model=8)
    eye = torch.eye(6)
    first = torch.zeros(6, 6)
    first[:, 0] = 1.0
    acc.add(1, torch.stack([eye, first])[:, None])  # two sequences, one head
    acc.add(2, torch.stack([eye, eye])[None])  # one sequence, two heads
    acc.add(2, torch.stack([first, first])[None])
    rows = acc.rows()
    d_first = window_mean(6, lambda t: t - 1)
    assert [r["heads"] for r in rows] == [1, 2] and [r["head_dim"] for r in rows] == [8, 4]
    assert rows[0]["D"] == pytest.approx(d_first / 2) and rows[1]["D"] == pytest.approx(d_first / 2)
    assert rows[0]["std"] == pytest.approx(torch.tensor([0.0, d_first]).std().item())
    assert rows[0]["sequences"] == 2
    with pytest.raises(ValueError, match="expected attention maps"):
        acc.add(1, torch.stack([eye, eye])[None])  # layer 1 has one head, not two


# --- `prism attention-distance` on real checkpoints -------------------------------------------------------
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

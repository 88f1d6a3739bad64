"""Eq. 1 (per-layer attention distance) on synthetic maps with known answers."""

from __future__ import annotations

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

"""Per-layer attention distance D_l (the paper's Eq. 1) and its summary over validation sequences.

    D_l = (1/h_l) sum_heads (1/|Q|) sum_{t in Q} sum_{s<=t} A[t, s] * |t - s|

with Q the second half of the context: 1-indexed positions floor(T/2)+1 .. T, i.e. 0-indexed rows
T//2 .. T-1 (|Q| = ceil(T/2)). The expression is linear in A, so the distance of the head-averaged map
equals the head average of the per-head distances: comparable across layers with different head counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


def query_rows(seq_len: int) -> range:
    """0-indexed query rows of Eq. 1's window Q for a context of ``seq_len`` tokens."""
    if seq_len < 1:
        raise ValueError(f"context length {seq_len} must be >= 1")
    return range(seq_len // 2, seq_len)


def distance_weights(seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """|t - s| for the query rows in Q against every key column: float64 [ceil(T/2), T]."""
    rows = query_rows(seq_len)
    t = torch.arange(rows.start, rows.stop, device=device, dtype=torch.float64)[:, None]
    s = torch.arange(seq_len, device=device, dtype=torch.float64)[None, :]
    return (t - s).abs()


def head_distances(probs: torch.Tensor) -> torch.Tensor:
    """Mean over Q of the expected distance, per head: probs [..., h, T, T] -> [..., h].

    Only the Q rows are read, and the product is reduced row-block by row-block in float64, so the
    extra memory is one [ceil(T/2), T] weight matrix whatever the head count.
    """
    if probs.dim() < 3 or probs.shape[-1] != probs.shape[-2]:
        raise ValueError(f"attention probabilities must be [..., heads, T, T], got shape {tuple(probs.shape)}")
    seq_len = probs.shape[-1]
    rows = query_rows(seq_len)
    weights = distance_weights(seq_len, probs.device)
    window = probs[..., rows.start : rows.stop, :]
    # Causality: columns s > t carry probability 0 in a causal map; |t - s| weights them anyway so a
    # non-causal map is not silently truncated. Sum over keys, then average over the query rows.
    per_row = torch.einsum("...qk,qk->...q", window.to(torch.float64), weights)
    return per_row.mean(dim=-1)


def layer_distance(probs: torch.Tensor) -> torch.Tensor:
    """Eq. 1 for one layer: probs [..., h, T, T] -> [...] (mean over heads of :func:`head_distances`)."""
    return head_distances(probs).mean(dim=-1)


@dataclass
class LayerSummary:
    layer: int  # 1-based, as in Megatron and the paper
    heads: int
    head_dim: int
    values: list[float] = field(default_factory=list)  # one D_l per sequence

    @property
    def mean(self) -> float:
        return sum(self.values) / len(self.values)

    @property
    def std(self) -> float:
        """Sample standard deviation over sequences (0 for a single sequence)."""
        n = len(self.values)
        if n < 2:
            return 0.0
        m = self.mean
        return math.sqrt(sum((v - m) ** 2 for v in self.values) / (n - 1))

    def row(self) -> dict[str, float | int]:
        return {
            "layer": self.layer,
            "D": self.mean,
            "std": self.std,
            "heads": self.heads,
            "head_dim": self.head_dim,
            "sequences": len(self.values),
        }


class DistanceAccumulator:
    """Collects D_l per sequence for every layer; feed it one layer's maps at a time."""

    def __init__(self, heads_per_layer: tuple[int, ...] | list[int], d_model: int):
        self.layers = [LayerSummary(i + 1, h, d_model // h) for i, h in enumerate(heads_per_layer)]

    def add(self, layer: int, probs: torch.Tensor) -> None:
        """``probs``: [batch, h_l, T, T] for 1-based ``layer``; appends one value per sequence."""
        summary = self.layers[layer - 1]
        if probs.dim() != 4 or probs.shape[1] != summary.heads:
            raise ValueError(
                f"layer {layer}: expected attention maps [batch, {summary.heads}, T, T], got {tuple(probs.shape)}"
            )
        summary.values.extend(layer_distance(probs).tolist())

    def rows(self) -> list[dict[str, float | int]]:
        missing = [s.layer for s in self.layers if not s.values]
        if missing:
            raise ValueError(f"no attention maps were recorded for layers {missing}")
        return [s.row() for s in self.layers]

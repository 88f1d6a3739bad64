"""Measure D_l on a model: read validation sequences from the prepared dataset, capture attention, reduce.

Sequences go through the model one at a time, and each layer's [1, h_l, T, T] map is reduced to a scalar
and dropped before the next sequence, so memory stays bounded at 1024 context.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from pipeline import dataset
from pipeline.analysis.distance import DistanceAccumulator
from pipeline.config import Config, ConfigError


def _manifest_with_split(dataset_dir: str | Path, split: str) -> dict:
    manifest = dataset.read_manifest(dataset_dir)
    if split not in manifest["splits"]:
        raise ConfigError(f"--split {split}: the dataset has splits {sorted(manifest['splits'])}; pick one")
    return manifest


def count_sequences(dataset_dir: str | Path, split: str = "val") -> int:
    manifest = _manifest_with_split(dataset_dir, split)
    return sum(s["samples"] for s in manifest["splits"][split]["shards"]) * manifest["sequences_per_sample"]


def iter_sequences(dataset_dir: str | Path, split: str = "val") -> Iterator[np.ndarray]:
    """Packed sequences of one split in manifest order, each shard verified against the manifest (sha256,
    members) before use: int64 [seq_len + 1] rows (inputs + targets)."""
    manifest = _manifest_with_split(dataset_dir, split)
    for row in dataset.iter_rows(dataset_dir, split, manifest):
        yield row.astype(np.int64)


def measure(model: torch.nn.Module, cfg: Config, sequences: Iterator[np.ndarray], n: int) -> list[dict]:
    """D_l per layer over the first ``n`` sequences: rows {layer, D, std, heads, head_dim, sequences}."""
    from pipeline.model import capture_attention, logits

    seq_len = cfg.model.seq_len
    acc = DistanceAccumulator(cfg.heads_per_layer, cfg.model.d_model)
    device = next(model.parameters()).device
    seen = 0
    model.eval()
    with torch.no_grad(), capture_attention(model) as maps:

        def reduce_layer(module, _args, _output):
            # Runs right after a layer's attention: reduce its map and drop it, so only one layer's
            # [1, h_l, T, T] probabilities are alive at any time.
            probs = maps.pop(module.layer_number, None)
            if probs is not None:
                acc.add(module.layer_number, probs)

        attention_modules = [m for m in model.modules() if hasattr(m, "core_attention") and hasattr(m, "layer_number")]
        handles = [m.register_forward_hook(reduce_layer) for m in attention_modules]
        try:
            for row in sequences:
                if seen == n:
                    break
                if len(row) - 1 < seq_len:
                    raise ConfigError(
                        f"the dataset's sequences hold {len(row) - 1} tokens but the model's context "
                        f"is model.seq_len={seq_len}; use the dataset the run trained on"
                    )
                logits(model, torch.from_numpy(row[:seq_len]).to(device)[None])
                for layer in sorted(maps):  # maps a layer hook did not pick up (none expected)
                    acc.add(layer, maps.pop(layer))
                seen += 1
        finally:
            for h in handles:
                h.remove()
    if seen < n:
        raise ConfigError(f"--sequences {n}: the split holds only {seen} sequences; ask for at most {seen}")
    return acc.rows()


def delta_rows(prism: list[list[dict]], uniform: list[list[dict]]) -> list[dict]:
    """ΔD_l = mean D_l over the Prism checkpoints − mean over the uniform ones, with its standard error:
    across checkpoints (seeds) when a group has several, else across that checkpoint's sequences."""

    def group(results: list[list[dict]], i: int) -> tuple[float, float, int]:
        values = [rows[i]["D"] for rows in results]
        mean = sum(values) / len(values)
        if len(values) > 1:
            var = sum((v - mean) ** 2 for v in values) / (len(values) - 1) / len(values)
        else:
            var = results[0][i]["std"] ** 2 / results[0][i]["sequences"]
        return mean, var, results[0][i]["heads"]

    layers = {len(rows) for rows in prism + uniform}
    if len(layers) != 1:
        raise ConfigError(
            f"--compare: the checkpoints have different layer counts {sorted(layers)}; compare runs of one scale"
        )
    out = []
    for i in range(layers.pop()):
        p_mean, p_var, p_heads = group(prism, i)
        u_mean, u_var, u_heads = group(uniform, i)
        out.append(
            {
                "layer": i + 1,
                "delta": p_mean - u_mean,
                "delta_se": (p_var + u_var) ** 0.5,
                "D_prism": p_mean,
                "D_uniform": u_mean,
                "heads_prism": p_heads,
                "heads_uniform": u_heads,
            }
        )
    return out

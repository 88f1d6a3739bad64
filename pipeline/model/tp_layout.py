"""How each weight of the model is split over tensor-parallel ranks: the one owner of that knowledge.

Megatron's layout (local and TransformerEngine specs): column-parallel weights are split over their output
rows (QKV, whose rows are grouped per head, so a rank holds whole heads; fc1; the vocab-parallel embedding and
output layer, over the vocabulary padded to a multiple of 128 x TP), row-parallel ones over their input
columns (the attention output ``linear_proj``, ``linear_fc2``). Norms and the biases of row-parallel layers
are whole on every rank, and so is the attention of a layer the config replicates (pipeline.model.replication).
A SwiGLU fc1 is [gate; up], and each rank holds [its gate rows; its up rows]: joining ranks un-interleaves them.

Readers: the TP gather of inference and the export (``gather``, pipeline.inference.read_whole_weights) and the resume at another TP size
(pipeline.checkpoint.reshard, which declares this layout to DeepSpeed's universal checkpoint). Torch-free apart from join.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeline.config import Config

VOCAB_PARALLEL = ("embedding.word_embeddings.weight", "output_layer.weight")
ROW_PARALLEL = ("linear_proj.weight", "linear_fc2.weight")
COLUMN_PARALLEL = ("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "linear_fc1.bias")
# whole on every rank: norms (TransformerEngine fuses them into the linear: layer_norm_*), row-parallel biases
WHOLE = (
    "layernorm.weight",
    "layernorm.bias",
    "layer_norm_weight",
    "layer_norm_bias",
    "linear_proj.bias",
    "linear_fc2.bias",
)


@dataclass(frozen=True)
class TPSplit:
    """dim: the dimension split over TP ranks (None: whole on every rank); halves: each rank's part is
    [gate rows; up rows] (SwiGLU fc1); vocab: rows are the vocabulary padded for the TP size."""

    dim: int | None
    halves: bool = False
    vocab: bool = False


def replicated_prefixes(cfg: Config) -> tuple[str, ...]:
    """Name prefixes of the attention modules the config replicates on every TP rank."""
    return tuple(f"decoder.layers.{p.number - 1}.self_attention." for p in cfg.layer_plan if p.replicated)


def tp_split(name: str, cfg: Config) -> TPSplit:
    """How weight ``name`` (a megatron GPTModel state-dict key) of ``cfg``'s model is split under TP.
    Raises ValueError for a name this layout does not know (a new module: say how it splits here)."""
    if name.startswith(replicated_prefixes(cfg)) or name.endswith(WHOLE):
        return TPSplit(None)
    if name in VOCAB_PARALLEL:
        return TPSplit(0, vocab=True)
    if name.endswith(ROW_PARALLEL):
        return TPSplit(1)
    if name.endswith(COLUMN_PARALLEL):
        return TPSplit(0, halves=".linear_fc1." in name and cfg.model.activation == "swiglu")
    raise ValueError(f"pipeline/model/tp_layout.py: no tensor-parallel split known for weight {name!r}")


def join(parts: list[Any], split: TPSplit) -> Any:
    """The whole tensor from the TP ranks' parts (rank order); vocab padding rows are kept."""
    import torch

    if split.dim is None or len(parts) == 1:
        return parts[0]
    if split.halves:
        gates, ups = zip(*(p.chunk(2, dim=split.dim) for p in parts))
        return torch.cat([*gates, *ups], dim=split.dim)
    return torch.cat(parts, dim=split.dim)


def gather(shards: list[dict[str, Any]], cfg: Config) -> dict[str, Any]:
    """One TP=1 megatron state dict from the TP ranks' (rank order), each weight joined as tp_split says it is
    split (the vocab padding of the TP size kept)."""
    import torch

    if len(shards) == 1:
        return shards[0]
    out = {}
    for name, first in shards[0].items():
        if not isinstance(first, torch.Tensor):  # megatron's _extra_state entries
            out[name] = first
        else:
            out[name] = join([shard[name] for shard in shards], tp_split(name, cfg))
    return out

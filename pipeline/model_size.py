"""The model's size in numbers: parameters, training FLOPs per token, the padded vocabulary.

The one place these are computed. The model (its embedding size), `prism plan`, `prism schedule show`,
`prism model report` and the trainer's MFU all read them, so every figure printed or logged is the same.
Pure arithmetic on plain numbers and the config, no torch, nothing of ours imported at run time: the
schedule's layer table and `prism plan` answer without loading a framework.

Conventions: a multiply-add is 2 FLOPs; training is forward + backward = 3 x forward; attention's score and
weighted-sum matmuls are counted in full (PaLM's convention); ``causal=True`` halves them for perf/mfu_causal
(pipeline.hardware says why both are logged).
Per layer h_l * d_h = d_model, so neither parameters nor FLOPs depend on the head count: that is Prism's
neutrality argument, and why ``heads`` is an argument that the formulas do not use beyond d_h.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.config import Config

VOCAB_MULTIPLE = 128  # per TP rank: even vocab shards, tensor-core friendly widths


# --- per layer, on plain numbers ------------------------------------------------------------------------
def layer_params(d_model: int, ffn_hidden: int, heads: int, *, bias: bool = False, gated: bool = True) -> int:
    """Weights of one block: fused QKV (d x 3d) + output (d x d) + MLP + two norm weights (a LayerNorm's
    biases are added by ``parameter_count``). ``heads`` does not appear: that is the whole point."""
    del heads  # shapes depend on h_l * d_h = d_model only
    attn = 4 * d_model * d_model + (4 * d_model if bias else 0)
    mlp = (3 if gated else 2) * d_model * ffn_hidden + (
        (2 * ffn_hidden if gated else ffn_hidden) + d_model if bias else 0
    )
    return attn + mlp + 2 * d_model


def layer_flops(d_model: int, ffn_hidden: int, heads: int, seq_len: int, *, gated: bool = True) -> dict[str, int]:
    """Forward FLOPs per token of one block. Attention scores and the weighted sum cost 2 * h_l * d_h *
    seq_len each (no causal discount), and h_l * d_h = d_model."""
    head_dim = d_model // heads
    return {
        "projections": 2 * 4 * d_model * d_model,
        "attention": 2 * 2 * heads * head_dim * seq_len,
        "mlp": 2 * (3 if gated else 2) * d_model * ffn_hidden,
    }


def training_flops_per_token(
    heads: Sequence[int],
    d_model: int,
    ffn_hidden: int,
    seq_len: int,
    vocab: int,
    *,
    gated: bool = True,
    causal: bool = False,
) -> int:
    """Forward + backward (x3) FLOPs per token: every block plus the logits projection over ``vocab``.
    ``causal``: attention's two matmuls halved, as a causal mask needs half of them (Megatron's and llm.c's
    convention, perf/mfu_causal; pipeline.hardware says why both are logged)."""
    per_layer = 0
    for h in heads:
        flops = layer_flops(d_model, ffn_hidden, h, seq_len, gated=gated)
        per_layer += sum(flops.values()) - (flops["attention"] // 2 if causal else 0)
    return 3 * (per_layer + 2 * d_model * vocab)


# --- the whole model, from its config -------------------------------------------------------------------
def padded_vocab(cfg: Config) -> int:
    """The model's vocabulary: model.vocab_size rounded up to a multiple of 128 x TP."""
    multiple = VOCAB_MULTIPLE * cfg.parallel.tp
    return -(-cfg.model.vocab_size // multiple) * multiple


def _gated(cfg: Config) -> bool:
    return cfg.model.activation == "swiglu"


def parameter_count(cfg: Config, heads: Sequence[int] | None = None) -> int:
    """Weights of the whole model (``heads`` default: the config's schedule): blocks with their norms (a
    LayerNorm has a bias per weight), the embedding over the padded vocab, an untied output layer, the final
    norm. Equal to the modules megatron builds (tests/unit/test_model_size.py)."""
    m = cfg.model
    norm_bias = m.d_model if m.norm == "layernorm" else 0
    blocks = sum(
        layer_params(m.d_model, m.ffn_hidden_size, h, bias=m.bias, gated=_gated(cfg)) + 2 * norm_bias
        for h in (cfg.heads_per_layer if heads is None else heads)
    )
    embedding = padded_vocab(cfg) * m.d_model
    output = 0 if m.tie_embeddings else embedding
    return blocks + embedding + output + m.d_model + norm_bias  # + the final norm


def flops_per_token(cfg: Config, heads: Sequence[int] | None = None, *, causal: bool = False) -> int:
    """Training FLOPs per token (``heads`` default: the config's schedule), each layer with its own h_l *
    d_h, plus the logits over the padded vocab: what MFU divides by (``causal``: perf/mfu_causal's count)."""
    m = cfg.model
    return training_flops_per_token(
        cfg.heads_per_layer if heads is None else heads,
        m.d_model,
        m.ffn_hidden_size,
        m.seq_len,
        padded_vocab(cfg),
        gated=_gated(cfg),
        causal=causal,
    )

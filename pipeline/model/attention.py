"""The Prism-specific attention pieces: per-layer RoPE and an SDPA core attention.

Megatron's `Attention` already derives every shape from the config it is built with, and the block hands
each layer its own config (see gpt.PrismTransformerConfig), so a layer with h_l heads of d_model / h_l
dims needs only two things here:
  * a rotary table for ITS head dim (GPTModel builds one table from the model-level kv_channels, which
    would be wrong for every layer whose d_h differs), cached per d_h and shared by layers;
  * a core attention on torch's scaled_dot_product_attention (FlashAttention kernels on GPU).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.module import MegatronModule

from pipeline.model.replication import mark_replicated, replicated_attention_groups


@functools.lru_cache(maxsize=64)
def rope_table(head_dim: int, seq_len: int, base: float, device: torch.device) -> torch.Tensor:
    """Rotation angles [seq_len, 1, 1, head_dim] in megatron's non-interleaved (rotate-half) layout:
    channel i and i + d/2 rotate together with frequency base^(-2i/d)."""
    with torch.inference_mode(False), torch.no_grad():  # a cached table must be a normal tensor
        return _angles(head_dim, seq_len, base, device)


def _angles(head_dim: int, seq_len: int, base: float, device: torch.device) -> torch.Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)
    return torch.cat((angles, angles), dim=-1)[:, None, None, :]


class PrismSelfAttention(SelfAttention):
    """megatron SelfAttention that applies RoPE with a table for its own head dim (kv_channels).

    A layer the plan marks replicated (``config.layer_plan``; only with parallel.replicate_indivisible_layers)
    gets a 1-rank "TP group" (pipeline.model.replication): its QKV/O weights and attention are whole on every
    TP rank, no collectives run, and the identical replicas see identical inputs and gradients."""

    def __init__(
        self, config, submodules, layer_number, attn_mask_type=None, cp_comm_type=None, pg_collection=None, **extra
    ):
        from megatron.core.transformer.enums import AttnMaskType

        from pipeline import compat

        self.plan = config.layer_plan[layer_number - 1]  # this layer's heads, head dim, replication
        if self.plan.replicated:
            pg_collection = replicated_attention_groups(pg_collection)
        super().__init__(
            config,
            submodules,
            layer_number,
            attn_mask_type or AttnMaskType.padding,
            cp_comm_type=cp_comm_type,
            pg_collection=pg_collection,
            **compat.self_attention_extra_kwargs(extra),  # e.g. 0.19's name=
        )
        if self.plan.replicated:
            mark_replicated(self.parameters())

    def forward(self, hidden_states, attention_mask, *args, **kwargs):
        seq_len = hidden_states.shape[0]  # [s, b, d]; no sequence parallelism
        kwargs["rotary_pos_emb"] = rope_table(
            self.config.kv_channels, seq_len, self.config.rope_base, hidden_states.device
        )
        return super().forward(hidden_states, attention_mask, *args, **kwargs)


class SDPAttention(MegatronModule):
    """Causal core attention on torch.nn.functional.scaled_dot_product_attention.

    Same call signature as megatron's DotProductAttention: q, k, v are [s, b, heads_per_rank, d_h] and the
    result is [s, b, heads_per_rank * d_h]. The mask argument is ignored: attention is causal."""

    def __init__(
        self,
        config,
        layer_number,
        attn_mask_type,
        attention_type,
        attention_dropout=None,
        softmax_scale=None,
        cp_comm_type=None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        if config.num_query_groups != config.num_attention_heads:
            raise ValueError("SDPAttention expects plain multi-head attention (num_query_groups = heads)")
        self.layer_number = layer_number
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale  # None: 1/sqrt(d_h), SDPA's default

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SDPAttention supports neither packed sequences nor attention bias")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d_h]
        dropout = self.dropout if self.training else 0.0
        with sdpa_kernel_context(self):
            out = self._sdpa(q, k, v, dropout)
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    def _sdpa(self, q, k, v, dropout):
        if dropout:
            from megatron.core import tensor_parallel

            # Heads are split over TP ranks: draw dropout masks from the TP-region RNG, as megatron does.
            with tensor_parallel.get_cuda_rng_tracker().fork():
                out = F.scaled_dot_product_attention(
                    q, k, v, dropout_p=dropout, is_causal=True, scale=self.softmax_scale
                )
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
        return out


def sdpa_kernel_context(module):
    """torch.nn.attention.sdpa_kernel for the kernel model.attention_backend pins (build_model sets
    ``module.sdpa_backend``), else no restriction."""
    import contextlib

    backend = getattr(module, "sdpa_backend", None)
    if backend is None:
        return contextlib.nullcontext()
    from torch.nn.attention import sdpa_kernel

    return sdpa_kernel(backend)

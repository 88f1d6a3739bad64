"""A Prism Transformer for Hugging Face `transformers` (loaded with trust_remote_code=True).

The block is a plain pre-norm decoder: x + attention(norm(x)), then x + SwiGLU(norm(x)), bias-free linears,
rotary position embeddings over the whole head (rotate-half), tied input/output embeddings. What makes it
Prism is only the attention: layer l splits the same hidden_size into heads_per_layer[l] heads of
head_dim_per_layer[l] dims, so each layer has its own head count, its own head dim, and a rotary table for
that head dim. Q, K, V and O stay hidden_size x hidden_size in every layer.

This file is copied into every export of a Prism checkpoint (`prism export`); the Prism repository tests it
against the training code's logits.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_prism import PrismConfig


def make_norm(config: PrismConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        return nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
    return nn.LayerNorm(config.hidden_size, eps=config.norm_eps)  # with bias


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class PrismAttention(nn.Module):
    """Causal self-attention with this layer's own head count and head dim."""

    def __init__(self, config: PrismConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.heads = config.heads_per_layer[layer_idx]
        self.head_dim = config.head_dim_per_layer[layer_idx]
        d = config.hidden_size
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)
        self.rope_theta = config.rope_theta

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """RoPE for THIS layer's head dim: channel i and i + head_dim/2 rotate together at theta^(-2i/head_dim).
        (Computed per call, not kept in a buffer: transformers builds models on the meta device.)"""
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=x.device) / self.head_dim
        angles = positions[:, None, :, None].float() / self.rope_theta**exponents  # [b, 1, s, head_dim / 2]
        angles = torch.cat((angles, angles), dim=-1)
        return x * angles.cos().to(x.dtype) + rotate_half(x) * angles.sin().to(x.dtype)

    def forward(self, x, positions, mask, cache):
        b, s, _ = x.shape
        q, k, v = (
            p(x).view(b, s, self.heads, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        q, k = self.rotate(q, positions), self.rotate(k, positions)
        if cache is not None:  # append this step's keys and values; attend over all of them
            k, v = cache.update(k, v, self.layer_idx)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class PrismMLP(nn.Module):
    def __init__(self, config: PrismConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class PrismDecoderLayer(nn.Module):
    def __init__(self, config: PrismConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = make_norm(config)
        self.self_attn = PrismAttention(config, layer_idx)
        self.post_attention_layernorm = make_norm(config)
        self.mlp = PrismMLP(config)

    def forward(self, x, positions, mask, cache):
        x = x + self.self_attn(self.input_layernorm(x), positions, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


def attention_mask_for(attention_mask, q_len: int, past: int, device) -> torch.Tensor | None:
    """None where plain causal attention is right (no cached keys, no padding); else a boolean
    [b, 1, q_len, past + q_len] mask: causal, padding keys hidden, each query always sees itself (a padding
    query with nothing else to see would give NaN, which would reach real tokens through its values)."""
    if past == 0 and (attention_mask is None or bool(attention_mask.all())):
        return None
    kv = past + q_len
    query_pos = past + torch.arange(q_len, device=device)[:, None]
    key_pos = torch.arange(kv, device=device)[None, :]
    allowed = (key_pos <= query_pos)[None, None]
    if attention_mask is not None:
        allowed = allowed & attention_mask[:, None, None, -kv:].bool()
    return allowed | (key_pos == query_pos)


class PrismPreTrainedModel(PreTrainedModel):
    config_class = PrismConfig
    base_model_prefix = "model"
    _no_split_modules = ["PrismDecoderLayer"]

    def _init_weights(self, module):
        super()._init_weights(module)


class PrismModel(PrismPreTrainedModel):
    def __init__(self, config: PrismConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(PrismDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = make_norm(config)
        self.post_init()

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None):
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = past + torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        mask = attention_mask_for(attention_mask, input_ids.shape[1], past, input_ids.device)
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, position_ids.expand(input_ids.shape[0], -1), mask, cache)
        return self.norm(x)


class PrismForCausalLM(PrismPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: PrismConfig):
        super().__init__(config)
        self.model = PrismModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def forward(
        self,
        input_ids,
        attention_mask=None,
        position_ids=None,
        cache=None,
        past_key_values=None,  # the older name of `cache`
        use_cache=None,
        labels=None,
        logits_to_keep=0,
        **kwargs,
    ):
        cache = cache if cache is not None else past_key_values
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        hidden = self.model(input_ids, attention_mask, position_ids, cache)
        logits = self.lm_head(hidden[:, -logits_to_keep:] if logits_to_keep else hidden)
        loss = None
        if labels is not None:  # next-token loss; -100 marks positions not to score
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache)

"""Weight names and layouts between our megatron GPTModel and the Hugging Face models we export to.

Every exported architecture (StableLM, Llama, and our own PrismForCausalLM) uses the same names: q/k/v/o,
gate/up/down, input_layernorm / post_attention_layernorm, model.norm. Megatron fuses Q, K and V into one
matrix whose rows are grouped per head ([heads, (q, k, v), head_dim]) and gate/up into one ([gate; up]).
"""

from __future__ import annotations

import torch

from pipeline.config import Config

NORMS = {"input_layernorm": "input_layernorm", "pre_mlp_layernorm": "post_attention_layernorm"}


def to_hf(weights: dict[str, torch.Tensor], cfg: Config) -> dict[str, torch.Tensor]:
    """HF state dict (vocab padding cut off; no lm_head when the embeddings are tied) from a TP=1 megatron one."""
    vocab, f = cfg.model.vocab_size, cfg.model.ffn_hidden_size
    out = {"model.embed_tokens.weight": weights["embedding.word_embeddings.weight"][:vocab]}
    for i, layer in enumerate(cfg.layer_plan):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        qkv = weights[src + "self_attention.linear_qkv.weight"]
        q, k, v = qkv.view(layer.heads, 3, layer.head_dim, -1).unbind(1)
        for name, t in zip("qkv", (q, k, v)):
            out[f"{dst}self_attn.{name}_proj.weight"] = t.reshape(layer.heads * layer.head_dim, -1)
        out[dst + "self_attn.o_proj.weight"] = weights[src + "self_attention.linear_proj.weight"]
        fc1 = weights[src + "mlp.linear_fc1.weight"]
        out[dst + "mlp.gate_proj.weight"], out[dst + "mlp.up_proj.weight"] = fc1[:f], fc1[f:]
        out[dst + "mlp.down_proj.weight"] = weights[src + "mlp.linear_fc2.weight"]
        for ours, theirs in NORMS.items():
            for part in ("weight", "bias"):
                if src + f"{ours}.{part}" in weights:
                    out[f"{dst}{theirs}.{part}"] = weights[src + f"{ours}.{part}"]
    for part in ("weight", "bias"):
        if f"decoder.final_layernorm.{part}" in weights:
            out[f"model.norm.{part}"] = weights[f"decoder.final_layernorm.{part}"]
    if not cfg.model.tie_embeddings:
        out["lm_head.weight"] = weights["output_layer.weight"][:vocab]
    return {k: v.clone(memory_format=torch.contiguous_format) for k, v in out.items()}  # own storage each


def from_hf(hf: dict[str, torch.Tensor], cfg: Config, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of to_hf into a copy of megatron state dict ``like`` (TP=1; its vocab padding rows kept).
    Raises KeyError / ValueError naming the first weight that is missing or has another shape."""
    out = dict(like)

    def put(name: str, value: torch.Tensor, rows: int | None = None) -> None:
        target = like[name]
        want = target.shape if rows is None else (rows, *target.shape[1:])
        if tuple(value.shape) != tuple(want):
            raise ValueError(f"{name}: export has shape {tuple(value.shape)}, the config needs {tuple(want)}")
        out[name] = target.clone()
        out[name][: value.shape[0]] = value.to(target.dtype)

    vocab = cfg.model.vocab_size
    put("embedding.word_embeddings.weight", hf["model.embed_tokens.weight"], rows=vocab)
    for i, layer in enumerate(cfg.layer_plan):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        qkv = [hf[f"{src}self_attn.{n}_proj.weight"].view(layer.heads, layer.head_dim, -1) for n in "qkv"]
        put(dst + "self_attention.linear_qkv.weight", torch.stack(qkv, 1).reshape(3 * cfg.model.d_model, -1))
        put(dst + "self_attention.linear_proj.weight", hf[src + "self_attn.o_proj.weight"])
        put(
            dst + "mlp.linear_fc1.weight", torch.cat([hf[src + "mlp.gate_proj.weight"], hf[src + "mlp.up_proj.weight"]])
        )
        put(dst + "mlp.linear_fc2.weight", hf[src + "mlp.down_proj.weight"])
        for ours, theirs in NORMS.items():
            for part in ("weight", "bias"):
                if dst + f"{ours}.{part}" in like:
                    put(dst + f"{ours}.{part}", hf[f"{src}{theirs}.{part}"])
    for part in ("weight", "bias"):
        if f"decoder.final_layernorm.{part}" in like:
            put(f"decoder.final_layernorm.{part}", hf[f"model.norm.{part}"])
    if not cfg.model.tie_embeddings:
        put("output_layer.weight", hf["lm_head.weight"], rows=vocab)
    return out

"""Neutrality of a schedule, proven from the real megatron modules (what `prism model report` prints).

Per layer: heads, d_h, parameters counted on the built layer, FLOPs per token; totals; then the same for
the uniform twin (h_base heads in every layer) and the equality checks. Built on the meta device, so the
757M preset reports in seconds without allocating weights.
"""

from __future__ import annotations

import dataclasses

from pipeline import distributed, model_size, schedule
from pipeline.config import Config, apply_overrides, from_dict
from pipeline.model.gpt import build_model


def uniform_twin(cfg: Config) -> Config:
    """The same model with h_base heads in every layer."""
    m = cfg.model
    data = apply_overrides(cfg.to_dict(), ["run.arm=uniform", f"schedule.heads={m.h_base}x{m.num_layers}"])
    return from_dict(data, cfg.source)


@dataclasses.dataclass
class ModelCount:
    heads: tuple[int, ...]
    layer_params: list[int]
    layer_flops: list[int]  # forward FLOPs per token of each block
    embedding_params: int
    other_params: int  # final norm, untied output layer
    total_params: int
    flops_per_token: int  # training (fwd + bwd), the MFU counter


def count(cfg: Config) -> ModelCount:
    """Parameters from the modules megatron builds (meta device), FLOPs from the shared counter."""
    cfg = from_dict(apply_overrides(cfg.to_dict(), ["parallel.tp=1"]), cfg.source)  # whole model on one rank
    distributed.init_model_parallel(1, cfg.run.seed)
    model = build_model(cfg, meta=True)
    m = cfg.model
    layer_params = [sum(p.numel() for p in layer.parameters()) for layer in model.decoder.layers]
    layer_flops = [
        sum(model_size.layer_flops(m.d_model, m.ffn_hidden_size, h, m.seq_len, gated=m.activation == "swiglu").values())
        for h in cfg.heads_per_layer
    ]
    total = sum(p.numel() for p in model.parameters())
    emb = model.embedding.word_embeddings.weight.numel()
    assert model_size.padded_vocab(cfg) * m.d_model == emb
    return ModelCount(
        tuple(cfg.heads_per_layer),
        layer_params,
        layer_flops,
        emb,
        total - emb - sum(layer_params),
        total,
        model_size.flops_per_token(cfg),
    )


def format_report(cfg: Config, c: ModelCount, title: str, kernels: list[str] | None = None) -> str:
    """``kernels``: the SDPA kernel of each layer on this machine (pipeline.model.sdpa_backend.layer_kernels)."""
    d = cfg.model.d_model
    kernels = kernels or [""] * len(c.heads)
    rows = [
        f"{title}: {cfg.run.arm} {cfg.run.scale}, schedule {schedule.compact(c.heads)}",
        f"{'layer':>5} {'heads':>5} {'d_h':>4} {'params':>12} {'fwd FLOPs/token':>16}  "
        + ("SDPA kernel" if any(kernels) else ""),
    ]
    for i, (h, p, f, k) in enumerate(zip(c.heads, c.layer_params, c.layer_flops, kernels)):
        rows.append(f"{i + 1:>5} {h:>5} {d // h:>4} {p:>12,} {f:>16,}  {k}".rstrip())
    rows += [
        f"{'embedding (tied output)' if cfg.model.tie_embeddings else 'embedding':<28} {c.embedding_params:>12,}",
        f"{'final norm / output layer':<28} {c.other_params:>12,}",
        f"{'total parameters':<28} {c.total_params:>12,}",
        f"{'training FLOPs per token':<28} {c.flops_per_token:>12,}",
    ]
    return "\n".join(rows)


def neutrality_checks(cfg: Config, ours: ModelCount, twin: ModelCount) -> dict[str, tuple]:
    """What must be identical between a schedule and its uniform twin: name -> (ours, twin)."""
    d = cfg.model.d_model
    return {
        "parameters": (ours.total_params, twin.total_params),
        "parameters per layer": (ours.layer_params, twin.layer_params),
        "training FLOPs per token": (ours.flops_per_token, twin.flops_per_token),
        "sum of h_l * d_h": (sum(h * (d // h) for h in ours.heads), sum(h * (d // h) for h in twin.heads)),
    }

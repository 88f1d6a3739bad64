"""`prism model report CONFIG`: neutrality of a schedule, proven from the real megatron modules.

Per layer: heads, d_h, parameters counted on the built layer, FLOPs per token; totals; then the same for
the uniform twin (h_base heads in every layer) and the equality checks. Built on the meta device, so the
757M preset reports in seconds without allocating weights.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from pipeline import schedule
from pipeline.config import Config, apply_overrides, from_dict, load


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("model", help="inspect the megatron-core model a config builds")
    verbs = p.add_subparsers(dest="model_verb", required=True, metavar="ACTION")
    r = verbs.add_parser("report", help="per-layer heads, d_h, params and FLOPs; checks against the uniform twin")
    r.add_argument("config")
    r.add_argument("overrides", nargs="*", help="dotted overrides, e.g. schedule.heads=3x2,6x2,8x2,12x6")
    r.set_defaults(func=_report)


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
    from pipeline import distributed
    from pipeline.model import build_model, flops_per_token, padded_vocab_size

    cfg = from_dict(apply_overrides(cfg.to_dict(), ["parallel.tp=1"]), cfg.source)  # whole model on one rank
    distributed.init_model_parallel(1, cfg.run.seed)
    model = build_model(cfg, meta=True)
    m = cfg.model
    layer_params = [sum(p.numel() for p in layer.parameters()) for layer in model.decoder.layers]
    layer_flops = [
        sum(schedule.layer_flops(m.d_model, m.ffn_hidden_size, h, m.seq_len, gated=m.activation == "swiglu").values())
        for h in cfg.heads_per_layer
    ]
    total = sum(p.numel() for p in model.parameters())
    emb = model.embedding.word_embeddings.weight.numel()
    assert padded_vocab_size(cfg) * m.d_model == emb
    return ModelCount(
        tuple(cfg.heads_per_layer),
        layer_params,
        layer_flops,
        emb,
        total - emb - sum(layer_params),
        total,
        flops_per_token(cfg),
    )


def format_report(cfg: Config, c: ModelCount, title: str) -> str:
    d = cfg.model.d_model
    rows = [
        f"{title}: {cfg.run.arm} {cfg.run.scale}, schedule {schedule.compact(c.heads)}",
        f"{'layer':>5} {'heads':>5} {'d_h':>4} {'params':>12} {'fwd FLOPs/token':>16}",
    ]
    for i, (h, p, f) in enumerate(zip(c.heads, c.layer_params, c.layer_flops)):
        rows.append(f"{i + 1:>5} {h:>5} {d // h:>4} {p:>12,} {f:>16,}")
    rows += [
        f"{'embedding (tied output)' if cfg.model.tie_embeddings else 'embedding':<28} {c.embedding_params:>12,}",
        f"{'final norm / output layer':<28} {c.other_params:>12,}",
        f"{'total parameters':<28} {c.total_params:>12,}",
        f"{'training FLOPs per token':<28} {c.flops_per_token:>12,}",
    ]
    return "\n".join(rows)


def _report(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    cfg = load(args.config, args.overrides)
    twin = uniform_twin(cfg)
    ours, theirs = count(cfg), count(twin)
    print(format_report(cfg, ours, "model"))
    print()
    print(format_report(twin, theirs, "uniform twin"))
    print()
    checks = {
        "parameters": (ours.total_params, theirs.total_params),
        "parameters per layer": (ours.layer_params, theirs.layer_params),
        "training FLOPs per token": (ours.flops_per_token, theirs.flops_per_token),
        "sum of h_l * d_h": (
            sum(h * (cfg.model.d_model // h) for h in ours.heads),
            sum(h * (cfg.model.d_model // h) for h in theirs.heads),
        ),
    }
    ok = True
    for name, (a, b) in checks.items():
        same = a == b
        ok &= same
        shown = f"{a:,}" if isinstance(a, int) else ("equal" if same else f"{a} vs {b}")
        print(f"check {name:<26} {'identical' if same else 'DIFFERENT'} ({shown})")
    print(f"neutral: {'yes' if ok else 'NO'} ({time.perf_counter() - start:.1f} s, counted on the meta device)")
    return 0 if ok else 1

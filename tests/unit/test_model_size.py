"""pipeline.model_size, the one owner of parameter counts, FLOPs per token and the padded vocabulary: the
per-layer arithmetic by hand, and every reader (`prism plan`, `prism schedule show`, the built model, the
trainer's MFU) printing or using the same figures."""

from __future__ import annotations

import io
import json
import re
from contextlib import redirect_stdout

import pytest

from pipeline import config, model_size
from pipeline.cli import main


def test_flops_and_params_do_not_depend_on_heads():
    d, ffn, seq = 768, 2048, 1024
    # written out by hand: QKV + output projection, SwiGLU's three matrices, two norm weights; per-token
    # forward FLOPs with h_l * d_h = d_model in the attention term
    params = 4 * d * d + 3 * d * ffn + 2 * d
    flops = {"projections": 2 * 4 * d * d, "attention": 2 * 2 * d * seq, "mlp": 2 * 3 * d * ffn}
    for h in (3, 6, 8, 12):
        assert model_size.layer_params(d, ffn, h) == params
        assert model_size.layer_flops(d, ffn, h, seq) == flops
    # but the counter does see a changed shape
    assert model_size.layer_flops(d, ffn, 12, 2 * seq)["attention"] == 2 * flops["attention"]
    # and a plain (non-gated) MLP has two matrices, not three
    assert model_size.layer_flops(d, ffn, 12, seq, gated=False)["mlp"] == 2 * 2 * d * ffn


def printed(*argv: str) -> str:
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(list(argv)) == 0
    return out.getvalue()


CONFIGS = [
    ("configs/tiny_prism.yaml",),
    ("configs/prism_124m.yaml",),  # vocab 50,257 padded to 50,304
    ("configs/uniform_124m.yaml", "model.activation=gelu", "model.tie_embeddings=false"),  # 2-matrix MLP, own output
]


@pytest.mark.megatron_compat
@pytest.mark.parametrize("preset", CONFIGS, ids=lambda c: " ".join(c))
def test_plan_schedule_show_model_and_mfu_agree(preset):
    """Before model_size, `schedule show` counted FLOPs over the unpadded vocab with a gated MLP whatever the
    config said, and block weights only: three different figures for one model."""
    from pipeline import distributed
    from pipeline.model import build_model
    from pipeline.train.diagnostics import mfu

    path, *overrides = preset
    cfg = config.load(path, overrides)
    planned = json.loads(printed("plan", path, *overrides, "--json"))
    shown = re.search(
        r"^\s+schedule: \S+\s+parameters\s+([\d,]+)\s+training FLOPs/token\s+([\d,]+)$",
        printed("schedule", "show", path, *overrides),
        re.M,
    )
    assert shown, "schedule show printed no totals line"
    shown_params, shown_flops = (int(g.replace(",", "")) for g in shown.groups())

    distributed.init_model_parallel(1, cfg.run.seed)
    built = sum(p.numel() for p in build_model(cfg, meta=True).parameters())
    mfu_flops = mfu(cfg, tokens_per_sec=1.0, peak=1.0, gpus=1)["perf/mfu"]  # MFU = FLOPs/token x tok/s / peak

    assert planned["parameters"] == shown_params == built == model_size.parameter_count(cfg)
    assert planned["flops_per_token"] == shown_flops == mfu_flops == model_size.flops_per_token(cfg)

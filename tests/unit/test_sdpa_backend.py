"""model.attention_backend: the SDPA kernel per head dim is logged, a pinned kernel really is the only one
enabled inside attention, and a kernel this device cannot run is refused in one line."""

from __future__ import annotations

import logging

import pytest
import torch

from pipeline import config, distributed
from pipeline.config import ConfigError
from pipeline.model import attention, sdpa_backend

TINY = "configs/tiny_prism.yaml"


def load(*overrides):
    return config.load(TINY, ["model.seq_len=16", *overrides])


def test_every_head_dim_gets_a_logged_kernel(caplog):
    cfg = load()
    dims = sorted({cfg.model.d_model // h for h in cfg.heads_per_layer})
    assert len(dims) == 3  # the tiny Prism plan has three head dims
    with caplog.at_level(logging.INFO, logger="pipeline.model.sdpa_backend"):
        kernels = sdpa_backend.check_and_log(cfg, "cpu")
    assert sorted(kernels) == dims
    assert all(k in ("FLASH_ATTENTION", "MATH") for k in kernels.values())  # what CPU torch has
    assert f"d_h {dims[-1]} ->" in caplog.text and "on cpu (CPU:" in caplog.text


@pytest.mark.parametrize("backend, flash, math", [("math", False, True), ("sdpa", True, True)])
def test_math_pins_inside_attention(monkeypatch, backend, flash, math):
    from pipeline.model import build_model

    seen = []
    real = attention.F.scaled_dot_product_attention

    def recording(*args, **kwargs):
        seen.append((torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.math_sdp_enabled()))
        return real(*args, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", recording)
    cfg = load(f"model.attention_backend={backend}")
    distributed.init_model_parallel(1, cfg.run.seed)
    model = build_model(cfg).eval()
    seen.clear()  # the build's probes
    with torch.no_grad():
        model(torch.zeros(1, 16, dtype=torch.long), None, None)
    assert len(seen) == cfg.model.num_layers and set(seen) == {(flash, math)}


def test_a_kernel_this_device_cannot_run_is_one_line():
    with pytest.raises(ConfigError) as err:
        sdpa_backend.check_and_log(load("model.attention_backend=efficient"), "cpu")
    msg = str(err.value)
    assert "\n" not in msg and "model.attention_backend: efficient attention cannot run on cpu" in msg

"""model.fusions=megatron and train.compile: each path runs its fused code and gives the plain path's loss
and gradients on CPU (same weights, fp32). Here, not in the unit suite: scripting megatron's fused SwiGLU
takes ~18 s on CPU. The compiled model is checked in test_compile.py beside this file."""

from __future__ import annotations

import pytest
import torch

from pipeline import config, distributed

TINY = "configs/tiny_prism.yaml"
SMALL = ["model.seq_len=64", "model.num_layers=4", "schedule.heads=3x2,12x2"]


def build(*overrides: str):
    from pipeline.model import build_model

    cfg = config.load(TINY, SMALL + list(overrides))
    distributed.init_model_parallel(1, cfg.run.seed)
    return cfg, build_model(cfg)


def loss_and_grads(model, tokens):
    from pipeline.model import lm_loss

    model.zero_grad(set_to_none=True)
    loss = lm_loss(model, tokens)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def plain():
    cfg, model = build()
    tokens = torch.randint(
        0, cfg.model.vocab_size, (2, cfg.model.seq_len + 1), generator=torch.Generator().manual_seed(0)
    )
    return model, tokens, *loss_and_grads(model, tokens)


def assert_same(plain, model):
    reference, tokens, loss, grads = plain
    model.load_state_dict(reference.state_dict())
    got_loss, got_grads = loss_and_grads(model, tokens)
    torch.testing.assert_close(got_loss, loss, rtol=1e-5, atol=0)
    assert got_grads.keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(got_grads[name], grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_megatron_fusions_run_the_fused_swiglu_and_match_the_plain_loss(plain, monkeypatch):
    import megatron.core.transformer.mlp as mlp

    calls = []
    fused = mlp.bias_swiglu_impl
    monkeypatch.setattr(mlp, "bias_swiglu_impl", lambda *a, **k: calls.append(1) or fused(*a, **k))
    cfg, model = build("model.fusions=megatron")
    assert model.config.bias_activation_fusion and model.config.bias_dropout_fusion
    assert not plain[0].config.bias_activation_fusion and not plain[0].config.bias_dropout_fusion
    assert_same(plain, model)
    assert len(calls) == cfg.model.num_layers  # every layer's MLP took the fused path


def test_megatron_fusions_leave_gelu_without_bias_unfused():
    """megatron refuses a fused GeLU without a bias: the flag stays off and the model builds."""
    _, model = build("model.fusions=megatron", "model.activation=gelu", "model.ffn_hidden_size=768")
    assert not model.config.bias_activation_fusion and model.config.bias_dropout_fusion


def test_new_keys_reject_bad_values():
    with pytest.raises(config.ConfigError, match="model.fusions"):
        config.load(TINY, ["model.fusions=apex"])
    with pytest.raises(config.ConfigError, match="train.compile"):
        config.load(TINY, ["train.compile=maybe"])

"""The megatron-core Prism GPT: per-layer attention vs a plain-PyTorch reference, backends, neutrality."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch

from pipeline import config, distributed, model_size
from pipeline.config import ConfigError

pytestmark = pytest.mark.megatron_compat

TINY = "configs/tiny_prism.yaml"
SMALL = ["model.seq_len=64"]  # the tiny preset at a shorter context: same layers, faster


def load(path: str = TINY, *overrides: str) -> config.Config:
    return config.load(path, SMALL + list(overrides))


@pytest.fixture(scope="module")
def tiny_model():
    from pipeline.model import build_model

    cfg = load()
    distributed.init_model_parallel(1, cfg.run.seed)
    return cfg, build_model(cfg).eval()


# --- per-layer attention against plain PyTorch -------------------------------------------------------
def reference_attention(x: torch.Tensor, attn, heads: int, rope_base: float, rope: bool = True) -> torch.Tensor:
    """Fused QKV split into h_l heads, RoPE (rotate-half), causal softmax, merge, output projection."""
    s, b, d = x.shape
    dh = d // heads
    qkv = (x @ attn.linear_qkv.weight.T).view(s, b, heads, 3, dh)  # megatron groups q, k, v per head
    q, k, v = (t.permute(1, 2, 0, 3) for t in qkv.unbind(dim=3))  # [b, h, s, dh]
    if rope:
        inv_freq = rope_base ** (-torch.arange(0, dh, 2, dtype=torch.float64) / dh)
        angles = torch.outer(torch.arange(s, dtype=torch.float64), inv_freq)
        cos = torch.cat([angles.cos(), angles.cos()], -1).float()
        sin = torch.cat([angles.sin(), angles.sin()], -1).float()

        def rotate(t):
            first, second = t[..., : dh // 2], t[..., dh // 2 :]
            return t * cos + torch.cat([-second, first], -1) * sin

        q, k = rotate(q), rotate(k)
    scores = q @ k.transpose(-1, -2) / math.sqrt(dh)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    probs = scores.softmax(-1)
    merged = (probs @ v).permute(2, 0, 1, 3).reshape(s, b, d)
    return merged @ attn.linear_proj.weight.T, probs


@pytest.mark.parametrize("layer_index", [0, 2, 4])  # 3 heads (d_h 64), 6 heads (32), baseline 12 (16)
def test_attention_matches_plain_pytorch(tiny_model, layer_index):
    cfg, model = tiny_model
    attn = model.decoder.layers[layer_index].self_attention
    heads = cfg.heads_per_layer[layer_index]
    assert (attn.num_attention_heads_per_partition, attn.hidden_size_per_attention_head) == (
        heads,
        cfg.model.d_model // heads,
    )
    x = 3 * torch.randn(32, 2, cfg.model.d_model, generator=torch.Generator().manual_seed(layer_index))
    with torch.no_grad():
        out, bias = attn(x, attention_mask=None)
        expected, _ = reference_attention(x, attn, heads, cfg.model.rope_base)
        without_rope, _ = reference_attention(x, attn, heads, cfg.model.rope_base, rope=False)
    assert bias is None
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # The comparison is sensitive to RoPE: leaving it out is far outside the tolerance.
    assert (out - without_rope).abs().max() > 1e-3


def test_capture_attention_gives_per_layer_probabilities(tiny_model):
    from pipeline.model import capture_attention, logits

    cfg, model = tiny_model
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = logits(model, tokens)
        hidden = {}
        handle = model.decoder.layers[2].register_forward_pre_hook(
            lambda m, a, kw: hidden.update(x=a[0] if a else kw["hidden_states"]), with_kwargs=True
        )
        with capture_attention(model) as maps:
            captured = logits(model, tokens)
        handle.remove()
    assert sorted(maps) == list(range(1, cfg.model.num_layers + 1))
    for layer, h in enumerate(cfg.heads_per_layer, start=1):
        assert maps[layer].shape == (2, h, 16, 16)
    # Layer 3's probabilities equal the reference's, computed from that layer's own normed input.
    layer = model.decoder.layers[2]
    with torch.no_grad():
        _, ref_probs = reference_attention(
            layer.input_layernorm(hidden["x"]), layer.self_attention, cfg.heads_per_layer[2], cfg.model.rope_base
        )
    torch.testing.assert_close(maps[3], ref_probs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(captured, plain, atol=0, rtol=0)  # capturing does not change the output
    assert not any(m._forward_pre_hooks for m in model.modules() if m.__class__.__name__ == "SDPAttention")
    model.train()
    try:
        with pytest.raises(RuntimeError, match="eval"), capture_attention(model):
            pass
    finally:
        model.eval()


# --- core attention backends, precision ---------------------------------------------------------------
def test_sdpa_and_megatron_core_attention_agree(tiny_model):
    from pipeline.model import build_model, lm_loss, logits

    cfg, sdpa = tiny_model
    megatron = build_model(load(TINY, "model.attention_backend=megatron"))
    assert type(megatron.decoder.layers[0].self_attention.core_attention).__name__ == "DotProductAttention"
    assert type(sdpa.decoder.layers[0].self_attention.core_attention).__name__ == "SDPAttention"
    megatron.load_state_dict(sdpa.state_dict())
    megatron.eval()
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 65), generator=torch.Generator().manual_seed(2))
    losses, grads = [], []
    for model in (sdpa, megatron):
        model.zero_grad(set_to_none=True)
        loss = lm_loss(model, tokens)
        loss.backward()
        losses.append(loss.detach())
        grads.append(model.decoder.layers[0].self_attention.linear_qkv.weight.grad.clone())
    with torch.no_grad():
        torch.testing.assert_close(logits(sdpa, tokens[:, :-1]), logits(megatron, tokens[:, :-1]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(losses[0], losses[1], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-4)
    sdpa.zero_grad(set_to_none=True)
    # a loss near log(vocab) at init: the model really predicts over the padded-off vocab only
    assert abs(losses[0].item() - math.log(cfg.model.vocab_size)) < 0.5


def test_bf16_model_and_fp32_loss(tiny_model):
    from pipeline.model import build_model, lm_loss

    cfg, fp32 = tiny_model
    bf16 = build_model(load(TINY, "train.precision=bf16"))
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    bf16.load_state_dict({k: v.bfloat16() if torch.is_tensor(v) else v for k, v in fp32.state_dict().items()})
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 65), generator=torch.Generator().manual_seed(3))
    loss = lm_loss(bf16, tokens)
    assert loss.dtype == torch.float32
    loss.backward()
    with torch.no_grad():
        assert abs(loss.item() - lm_loss(fp32, tokens).item()) < 0.05


# --- neutrality and the FLOP counter ---------------------------------------------------------------------
PAPER = {"124m": 124e6, "354m": 354e6, "757m": 757e6}


@pytest.mark.parametrize("scale", ["tiny", "124m", "354m", "757m"])
def test_both_arms_build_the_parameters_the_schedule_arithmetic_predicts(scale):
    """Each arm's built modules (meta device) against model_size.layer_params for that layer's own h_l:
    a layer built with the wrong head count or head dim has a QKV that is not d x 3d and fails here."""
    from pipeline.model import build_model

    arms = ("tiny_prism", "tiny_uniform") if scale == "tiny" else (f"prism_{scale}", f"uniform_{scale}")
    prism, uniform = (config.load(f"configs/{name}.yaml") for name in arms)
    assert len(set(prism.heads_per_layer)) > 1 and len(set(uniform.heads_per_layer)) == 1
    distributed.init_model_parallel(1, prism.run.seed)
    totals = []
    for cfg in (prism, uniform):
        m = cfg.model
        model = build_model(cfg, meta=True)
        for layer, plan in zip(model.decoder.layers, cfg.layer_plan, strict=True):
            attn = layer.self_attention
            assert (attn.num_attention_heads_per_partition, attn.hidden_size_per_attention_head) == (
                plan.heads,
                plan.head_dim,
            )
            assert attn.linear_qkv.weight.shape == (3 * m.d_model, m.d_model)
            norm_biases = 2 * m.d_model  # LayerNorm biases; model_size.layer_params counts weights only
            assert sum(p.numel() for p in layer.parameters()) == norm_biases + model_size.layer_params(
                m.d_model, m.ffn_hidden_size, plan.heads
            )
        total = sum(p.numel() for p in model.parameters())
        per_layer = model_size.layer_params(m.d_model, m.ffn_hidden_size, m.h_base) + 2 * m.d_model
        assert (
            total == model_size.padded_vocab(cfg) * m.d_model + m.num_layers * per_layer + 2 * m.d_model
        )  # + final norm
        totals.append(total)
    assert totals[0] == totals[1]
    if scale in PAPER:
        assert abs(totals[0] / PAPER[scale] - 1) < 0.01, totals[0]


def test_flops_per_token_counts_every_layer_and_the_padded_vocab():
    from pipeline.model.report import uniform_twin
    from pipeline.model_size import flops_per_token, padded_vocab

    for path in (TINY, "configs/prism_124m.yaml", "configs/prism_757m.yaml"):
        cfg = config.load(path)
        m, v = cfg.model, padded_vocab(cfg)
        # Written out by hand: per layer 4 d^2 projections, 2 * s * (h_l * d_h = d) attention, 3 d ffn MLP.
        per_layer = 2 * 4 * m.d_model**2 + 2 * 2 * m.d_model * m.seq_len + 2 * 3 * m.d_model * m.ffn_hidden_size
        assert flops_per_token(cfg) == 3 * (m.num_layers * per_layer + 2 * m.d_model * v)
        assert flops_per_token(cfg) == flops_per_token(uniform_twin(cfg))
    assert padded_vocab(config.load("configs/prism_124m.yaml")) == 50304
    assert padded_vocab(config.load("configs/prism_354m.yaml", ["parallel.tp=2"])) == 50432


# --- refusals ---------------------------------------------------------------------------------------------
def test_schedule_breaking_tp_rule_is_refused_before_weights():
    with pytest.raises(ConfigError, match=r"schedule\.heads.*multiple of 2") as e:
        load(TINY, "parallel.tp=2")
    assert "\n" not in str(e.value)
    # the loader is the one gate: a loaded config cannot be changed past it, only derived through it
    cfg = load()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.parallel.tp = 2
    with pytest.raises(ConfigError, match=r"schedule\.heads.*multiple of 2"):
        config.from_dict(config.apply_overrides(cfg.to_dict(), ["parallel.tp=2"]), cfg.source)


def test_tp_size_must_match_the_initialised_groups(tiny_model):
    from pipeline.model import build_model

    cfg = load(TINY, "schedule.heads=6x2,12x6", "parallel.tp=2")  # valid at TP=2, but the world is TP=1
    with pytest.raises(ConfigError, match=re.escape("init_model_parallel(2")):
        build_model(cfg)


def test_attention_modules_read_the_layer_plan(tiny_model):
    cfg, model = tiny_model
    attns = [layer.self_attention for layer in model.decoder.layers]
    assert [a.plan for a in attns] == list(cfg.layer_plan)
    assert [a.config.kv_channels for a in attns] == [p.head_dim for p in cfg.layer_plan]  # RoPE table size
    assert all(a.linear_qkv.weight.tensor_model_parallel for a in attns)  # TP=1: nothing replicated


def test_replication_is_opt_in_and_its_extra_flops_are_counted(tiny_model, caplog):
    from pipeline.model.gpt import replicated_layers, replication_overhead, transformer_config

    cfg = load(TINY, "parallel.tp=2", "parallel.replicate_indivisible_layers=true")
    assert replicated_layers(cfg) == [1, 2]  # the two 3-head layers
    m = cfg.model
    per_layer = 3 * (2 * 4 * m.d_model**2 + 2 * 2 * m.d_model * m.seq_len)  # projections + attention, fwd+bwd
    assert replication_overhead(cfg) == 2 * per_layer // 2  # each rank does the other rank's half too
    assert replication_overhead(load(TINY, "schedule.heads=6x2,12x6", "parallel.tp=2")) == 0
    with pytest.raises(ConfigError, match="model.dropout"):  # replicas would draw different dropout masks
        load(TINY, "parallel.tp=2", "parallel.replicate_indivisible_layers=true", "model.dropout=0.1")
    # the replicated layers' per-layer megatron config asks for no TP split; the others keep TP=2
    tcfg = transformer_config(cfg, meta=True)
    assert [tcfg.get_config_for_layer(n).tensor_model_parallel_size for n in range(1, 9)] == [1, 1] + [2] * 6


def test_model_report_cli_proves_neutrality_for_757m(tiny_model, capsys):
    from pipeline.cli import main

    assert main(["model", "report", "configs/prism_757m.yaml"]) == 0
    out = capsys.readouterr().out
    totals = re.findall(r"total parameters\s+([\d,]+)", out)
    flops = re.findall(r"training FLOPs per token\s+([\d,]+)", out)
    assert len(totals) == 2 and totals[0] == totals[1] and len(set(flops)) == 1
    assert "schedule 6x3,12x3,16x18" in out and "schedule 16x24" in out
    assert re.search(r"^\s+1\s+6\s+256\s", out, re.M)  # layer 1: 6 heads of d_h 256
    assert "neutral: yes" in out and "DIFFERENT" not in out
    assert main(["model", "report", "configs/missing.yaml"]) == 2
    assert "prism model: error: configs/missing.yaml: config file not found" in capsys.readouterr().err

"""Hugging Face export: the exported architectures give the trainer's logits, the weight mapping inverts,
and transformers' cached greedy decoding equals a plain argmax loop (tiny random models, in-process)."""

from __future__ import annotations

import functools

import pytest
import torch

from pipeline import config, distributed
from pipeline.config import ConfigError

pytestmark = pytest.mark.megatron_compat

SMALL = ["model.seq_len=64"]


@functools.cache  # each model once per session: building one is most of these tests' time
def trainer_model(preset: str, *overrides: str):
    """A tiny GPTModel with random weights, norms included (they start at 1 and 0, which would hide a
    weight or bias mapped to the wrong place)."""
    from pipeline.model import build_model

    cfg = config.load(f"configs/tiny_{preset}.yaml", [*SMALL, *overrides])
    distributed.init_model_parallel(1, cfg.run.seed)
    model = build_model(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return cfg, model


def hf_model(cfg, weights):
    from transformers import AutoModelForCausalLM

    from pipeline.export import convert, hf

    config_obj = hf.hf_config(cfg, eos_id=0, dtype="fp32")
    if hf.architecture(cfg) == "prism":
        from pipeline.export.modeling_prism import PrismForCausalLM

        model = PrismForCausalLM(config_obj)
    else:
        model = AutoModelForCausalLM.from_config(config_obj)
    state = convert.to_hf(weights, cfg)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # lm_head is tied to the embeddings
    model.tie_weights()
    return model.eval()


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / a.abs().max()).item()


CASES = {
    "prism": ("prism", [], "PrismForCausalLM"),
    "uniform": ("uniform", [], "StableLmForCausalLM"),
    "uniform-rmsnorm": ("uniform", ["model.norm=rmsnorm"], "LlamaForCausalLM"),
    "prism-rmsnorm-untied": ("prism", ["model.norm=rmsnorm", "model.tie_embeddings=false"], "PrismForCausalLM"),
}


@pytest.mark.parametrize("case", CASES)
def test_exported_logits_equal_the_trainers(case):
    from pipeline.model import logits

    preset, overrides, want_class = CASES[case]
    cfg, model = trainer_model(preset, *overrides)
    exported = hf_model(cfg, model.state_dict())
    assert type(exported).__name__ == want_class
    tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = logits(model, tokens), exported(tokens).logits
    assert theirs.shape == ours.shape
    assert relative_error(ours, theirs) <= 1e-4


@pytest.mark.parametrize("preset", ["prism", "uniform"])
def test_weight_mapping_round_trips(preset):
    from pipeline.export import convert

    cfg, model = trainer_model(preset)
    weights = model.state_dict()
    back = convert.from_hf(convert.to_hf(weights, cfg), cfg, weights)
    for name, value in weights.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(back[name], value), name


@pytest.mark.parametrize("preset", ["prism", "uniform"])
def test_cached_greedy_generation_equals_an_argmax_loop(preset):
    cfg, model = trainer_model(preset)
    exported = hf_model(cfg, model.state_dict())
    prompt = torch.randint(1, cfg.model.vocab_size, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cached = exported.generate(prompt, max_new_tokens=32, do_sample=False, use_cache=True, eos_token_id=None)
        tokens = prompt
        for _ in range(32):  # the whole sequence again at every step: no cache
            next_token = exported(tokens, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, next_token], dim=1)
    assert torch.equal(cached, tokens)


def test_prism_model_handles_left_padding():
    """A left-padded row in a batch gives the same logits as the same row alone (the mask and positions)."""
    cfg, model = trainer_model("prism")
    exported = hf_model(cfg, model.state_dict())
    row = torch.randint(1, cfg.model.vocab_size, (1, 10), generator=torch.Generator().manual_seed(2))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), row], dim=1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 10, dtype=torch.long)], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        alone = exported(row).logits
        batched = exported(padded, attention_mask=mask, position_ids=positions).logits[:, 3:]
    assert relative_error(alone, batched) <= 1e-5


def test_init_from_refuses_another_shape(tmp_path):
    from pipeline.export import hf

    cfg, _ = trainer_model("prism")
    other = config.load("configs/tiny_uniform.yaml", SMALL)
    with pytest.raises(ConfigError, match=r"schedule.heads=\[12, 12.*set schedule.heads to match"):
        hf.check_shape(cfg, hf.hf_config(other, 0, "fp32").to_dict(), tmp_path)
    hf.check_shape(cfg, hf.hf_config(cfg, 0, "fp32").to_dict(), tmp_path)  # its own shape passes


@pytest.mark.parametrize("preset", ["prism", "uniform"])
def test_bf16_export_stays_near_the_fp32_masters(preset):
    """A bf16 export rounds each weight to 8 mantissa bits (relative 2^-9 ~ 2e-3 each) and computes in bf16:
    measured 5e-3 of the logits' range for both arms; 2e-2 allowed. A wrong mapping is off by ~1."""
    from pipeline.model import logits

    cfg, model = trainer_model(preset)
    exported = hf_model(cfg, model.state_dict()).to(torch.bfloat16)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        masters, bf16 = logits(model, tokens), exported(tokens).logits.float()
    assert relative_error(masters, bf16) <= 2e-2

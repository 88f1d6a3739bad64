"""Config loading: presets, validation messages, overrides, hash, dump."""

from pathlib import Path

import pytest
import yaml

from pipeline import config, schedule
from pipeline.config import ConfigError

CONFIGS = sorted(Path("configs").glob("*.yaml"))
PAPER = {  # scale -> (layers, d_model, h_base, batch tokens, peak lr, train tokens, schedule preset)
    "124m": (12, 768, 12, 262144, 6e-4, 2_880_000_000, "paper-124m"),
    "354m": (24, 1024, 16, 262144, 3e-4, 10_490_000_000, "paper-354m"),
    "757m": (24, 1536, 16, 524288, 2.5e-4, 20_970_000_000, "paper-757m"),
}


def write(tmp_path, data) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def tiny_dict() -> dict:
    return yaml.safe_load(Path("configs/tiny_prism.yaml").read_text())


def test_all_presets_load():
    names = {p.stem for p in CONFIGS}
    assert {f"{a}_{s}" for a in ("uniform", "prism") for s in ("124m", "354m", "757m", "tiny")} - {
        "uniform_tiny",
        "prism_tiny",
    } | {"tiny_uniform", "tiny_prism"} <= names
    for p in CONFIGS:
        cfg = config.load(p)
        assert len(cfg.heads_per_layer) == cfg.model.num_layers


@pytest.mark.parametrize("scale", list(PAPER))
def test_paper_presets_carry_the_paper_settings(scale):
    layers, d, h_base, batch, lr, tokens, preset = PAPER[scale]
    arms = {arm: config.load(f"configs/{arm}_{scale}.yaml") for arm in ("uniform", "prism")}
    for arm, cfg in arms.items():
        m, t = cfg.model, cfg.train
        assert (m.num_layers, m.d_model, m.h_base, m.seq_len) == (layers, d, h_base, 1024)
        assert (t.batch_tokens, t.lr, t.train_tokens) == (batch, lr, tokens)
        assert (t.beta1, t.beta2, t.eps, t.weight_decay, t.grad_clip, t.warmup_fraction) == (
            0.9,
            0.95,
            1e-8,
            0.1,
            1.0,
            0.025,
        )
        assert m.tie_embeddings and not m.bias and m.activation == "swiglu" and t.precision == "bf16"
        assert abs(3 * m.ffn_hidden_size - 8 * d) <= 3 * 64  # SwiGLU hidden ~ 8/3 d
        assert cfg.run.arm == arm
    assert arms["prism"].heads_per_layer == schedule.preset(preset)
    assert arms["uniform"].heads_per_layer == (h_base,) * layers
    # the twins differ only in arm and schedule
    a, b = (config.flatten(c.to_dict()) for c in arms.values())
    assert {k for k in a if a[k] != b[k]} == {"run.arm", "schedule.heads"}


def test_tiny_presets_are_twins():
    u, p = config.load("configs/tiny_uniform.yaml"), config.load("configs/tiny_prism.yaml")
    assert (p.model.d_model, p.model.num_layers, p.model.seq_len) == (256, 8, 256)
    assert sorted({p.model.d_model // h for h in p.heads_per_layer}, reverse=True) == [256, 128, 64]
    a, b = config.flatten(u.to_dict()), config.flatten(p.to_dict())
    assert {k for k in a if a[k] != b[k]} == {"run.arm", "schedule.heads"}


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d["train"].update(bogus=1), "train.bogus: unknown key; allowed keys here: batch_tokens"),
        (
            lambda d: d["model"].update(d_model="wide"),
            "model.d_model: 'wide' has the wrong type; expected int",
        ),
        (lambda d: d["model"].pop("num_layers"), "model.num_layers: missing required key"),
        (
            lambda d: d["model"].update(norm="batchnorm"),
            "model.norm: 'batchnorm' is not allowed; choose one of 'layernorm' | 'rmsnorm'",
        ),
        (
            lambda d: d["train"].update(batch_tokens=5000),
            "train.batch_tokens=5000 is not divisible by seq_len x micro_batch_size x DP",
        ),
        (
            lambda d: d["parallel"].update(tp=2, zero_stage=3),
            "parallel.zero_stage: ZeRO stage 3 is only supported with parallel.tp=1",
        ),
        (
            lambda d: d["parallel"].update(tp=2),
            "schedule.heads: schedule 1x2,2x2,4x4: rule 'tensor-parallel'",
        ),
        (
            lambda d: d["schedule"].update(heads="1x2,2x2,4x3"),
            "schedule.heads: lists 7 layers but model.num_layers=8",
        ),
        (lambda d: d["run"].update(arm="uniform"), "run.arm: 'uniform' needs a constant schedule"),
        (lambda d: d.pop("data"), "data: missing required key"),
    ],
)
def test_bad_configs_give_one_line_naming_file_and_key(tmp_path, mutate, message):
    d = tiny_dict()
    mutate(d)
    path = write(tmp_path, d)
    with pytest.raises(ConfigError) as e:
        config.load(path)
    text = str(e.value)
    assert "\n" not in text
    assert text.startswith(str(path))
    assert message in text


def test_dp_divisibility_is_checked_for_the_real_world_size():
    cfg = config.load("configs/tiny_prism.yaml")
    assert cfg.steps(2) == {"total": 384, "warmup": 10, "grad_accum": 1}
    assert cfg.steps(1)["grad_accum"] == 2
    with pytest.raises(ConfigError, match=r"256 x 4 x 3 = 3072"):
        cfg.steps(3)


def test_overrides_and_hash():
    base = config.load("configs/tiny_prism.yaml")
    over = config.load(
        "configs/tiny_prism.yaml", ["train.lr=3e-4", "schedule.heads=2x4,4x4", "tracking.milestones=[5.0]"]
    )
    assert over.train.lr == 3e-4 and over.heads_per_layer == (2,) * 4 + (4,) * 4 and over.tracking.milestones == [5.0]
    assert base.hash() == config.load("configs/tiny_prism.yaml").hash()
    assert base.hash() != over.hash()
    with pytest.raises(ConfigError, match="write it as section.key=value"):
        config.load("configs/tiny_prism.yaml", ["train.lr"])
    with pytest.raises(ConfigError, match="train.nope: unknown key"):
        config.load("configs/tiny_prism.yaml", ["train.nope=1"])


def test_dump_round_trips_verbatim(tmp_path):
    cfg = config.load("configs/prism_124m.yaml", ["train.lr=1e-3"])
    p = tmp_path / "dumped.yaml"
    p.write_text(cfg.dump())
    again = config.load(p)
    assert again.to_dict() == cfg.to_dict() and again.hash() == cfg.hash()


def test_changed_keys_names_model_and_data_keys_only():
    a = config.load("configs/tiny_prism.yaml").to_dict()
    b = config.load(
        "configs/tiny_prism.yaml", ["model.ffn_hidden_size=512", "train.log_every=1", "data.tasks=4"]
    ).to_dict()
    assert config.changed_keys(a, b) == ["model.ffn_hidden_size"]


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        config.load(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        config.load(bad)

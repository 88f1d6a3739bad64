"""Config loading: presets and their base overlays, validation messages, overrides, hash, dump, the
per-layer plan, immutability."""

import dataclasses
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
    return config.read_yaml("configs/tiny_prism.yaml")


def differing(a: config.Config, b: config.Config) -> set[str]:
    x, y = config.flatten(a.to_dict()), config.flatten(b.to_dict())
    return {k for k in x.keys() | y.keys() if x.get(k) != y.get(k)}


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
    assert arms["prism"].experiment == arms["uniform"].experiment == f"prism-{scale}"  # one experiment


def test_tiny_presets_keep_the_papers_ratios():
    p = config.load("configs/tiny_prism.yaml")
    m, heads = p.model, p.heads_per_layer
    assert (m.d_model, m.num_layers, m.seq_len, m.h_base) == (192, 8, 256, 12)  # 124M's h_base, 1/4 width
    assert sorted({m.d_model // h for h in heads}, reverse=True) == [64, 32, 16]
    assert m.d_model // heads[0] == 4 * (m.d_model // m.h_base)  # first-stage d_h = 4x the baseline's
    assert heads[0] >= 3  # several heads from the first layer (the paper never trains h_1 = 1)
    assert all(e - s >= 2 for _, s, e in schedule.stages(heads))  # no single-layer stage
    assert sum(h == m.h_base for h in heads) >= m.num_layers / 2


@pytest.mark.parametrize("scale", ["tiny", *PAPER])
def test_arm_overlays_resolve_to_twins(scale):
    names = ("tiny_uniform", "tiny_prism") if scale == "tiny" else (f"uniform_{scale}", f"prism_{scale}")
    u, p = (config.load(f"configs/{n}.yaml") for n in names)
    assert differing(u, p) == {"run.arm", "schedule.heads"}
    # each overlay names only the arm and the schedule; everything else comes from its base
    for name in names:
        raw = yaml.safe_load(Path(f"configs/{name}.yaml").read_text())
        assert raw.pop("base").startswith("base/") and raw == {
            "run": {"arm": raw["run"]["arm"]},
            "schedule": raw["schedule"],
        }


def test_an_overlay_that_changes_the_model_is_not_a_twin(tmp_path):
    (tmp_path / "wide.yaml").write_text(
        "base: " + str(Path("configs/tiny_prism.yaml").resolve()) + "\nmodel: {d_model: 384, ffn_hidden_size: 1024}\n"
    )
    wide, prism = config.load(tmp_path / "wide.yaml"), config.load("configs/tiny_prism.yaml")
    assert differing(wide, prism) == {"model.d_model", "model.ffn_hidden_size"}
    assert wide.model.h_base == 12 and wide.layer_plan[0].head_dim == 128  # merged, not replaced


# --- base: overlays -----------------------------------------------------------------------------------
def test_base_is_deep_merged_relative_to_the_file_and_overrides_come_last(tmp_path):
    (tmp_path / "bases").mkdir()
    (tmp_path / "bases" / "root.yaml").write_text(yaml.safe_dump(tiny_dict()))
    (tmp_path / "bases" / "mid.yaml").write_text(
        "base: root.yaml\ntrain: {lr: 1.0e-3}\ntracking: {milestones: [9.0]}\n"
    )
    (tmp_path / "arm.yaml").write_text("base: bases/mid.yaml\ntrain: {min_lr: 1.0e-4}\n")
    cfg = config.load(tmp_path / "arm.yaml", ["train.lr=5e-4"])
    tiny = config.load("configs/tiny_prism.yaml")
    assert (cfg.train.lr, cfg.train.min_lr) == (5e-4, 1e-4)  # the override wins over both files
    assert cfg.train.batch_tokens == tiny.train.batch_tokens  # siblings of a merged key survive
    assert cfg.tracking.milestones == (9.0,)  # a list is replaced, not appended to
    assert differing(cfg, tiny) == {"train.lr", "train.min_lr", "tracking.milestones"}
    assert cfg.source == str(tmp_path / "arm.yaml") and "base" not in cfg.to_dict()


@pytest.mark.parametrize(
    "files, message",
    [
        ({"c.yaml": "base: nope.yaml\n"}, "c.yaml: base nope.yaml: config file not found in {d} or "),
        ({"c.yaml": "base: d.yaml\n", "d.yaml": "base: c.yaml\n"}, "c.yaml: base files form a cycle"),
        ({"c.yaml": "base: c.yaml\n"}, "c.yaml: base files form a cycle"),
        ({"c.yaml": "base: d.yaml\n", "d.yaml": "- a list\n"}, "d.yaml: the top level must be a mapping"),
        ({"c.yaml": "base: [d.yaml]\n"}, "c.yaml: base: ['d.yaml'] must be a file name"),
        ({"c.yaml": "base: d.yaml\n", "d.yaml": "model: [unclosed\n"}, "d.yaml: not valid YAML"),
    ],
)
def test_bad_base_gives_one_line_naming_the_file(tmp_path, files, message):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError) as e:
        config.load(tmp_path / "c.yaml")
    assert "\n" not in str(e.value) and message.format(d=tmp_path) in str(e.value)
    assert str(e.value).startswith(str(tmp_path))


def test_a_copied_preset_finds_its_base_among_the_project_configs(tmp_path):
    """Presets are overlays (`base: base/tiny.yaml`); a user copies one elsewhere to change it."""
    from tests.unit.test_schedule import prism

    copy = tmp_path / "mine" / "tiny_prism.yaml"
    copy.parent.mkdir()
    copy.write_text(Path("configs/tiny_prism.yaml").read_text())
    assert config.load(copy).to_dict() == config.load("configs/tiny_prism.yaml").to_dict()
    out = prism("schedule", "validate", str(copy))
    assert out.returncode == 0 and "3x2,6x2,12x4 is valid" in out.stdout, out.stderr
    # a base found next to the file wins over the project's
    (copy.parent / "base").mkdir()
    (copy.parent / "base" / "tiny.yaml").write_text(
        f"base: {config.PROJECT_CONFIGS / 'base' / 'tiny.yaml'}\ntrain: {{lr: 1.0e-3}}\n"
    )
    assert config.load(copy).train.lr == 1e-3
    # neither place has it: one line naming both, exit 2
    copy.write_text(copy.read_text().replace("base/tiny.yaml", "base/nowhere.yaml"))
    out = prism("schedule", "validate", str(copy))
    assert out.returncode == 2 and out.stdout == "" and out.stderr.count("\n") == 1
    assert f"base base/nowhere.yaml: config file not found in {copy.parent} or {config.PROJECT_CONFIGS}" in out.stderr


# --- one parse, one plan, immutable ---------------------------------------------------------------------
def test_loaded_config_is_immutable_and_the_schedule_is_parsed_once(monkeypatch):
    cfg = config.load("configs/tiny_prism.yaml")
    for section, key, value in (("train", "lr", 1.0), ("parallel", "tp", 2)):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(getattr(cfg, section), key, value)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.source = "elsewhere"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.heads_per_layer = (4,) * 8
    assert cfg.tracking.milestones == (7.0, 6.5, 6.0, 5.5, 5.0)  # a tuple: no append either
    # a stored value, not a property that parses again on every read
    monkeypatch.setattr(schedule, "parse", lambda *a: pytest.fail("schedule parsed after load"))
    assert cfg.heads_per_layer == (3, 3, 6, 6, 12, 12, 12, 12) and len(cfg.layer_plan) == 8
    assert "heads_per_layer" not in cfg.to_dict() and "layer_plan" not in cfg.dump()


@pytest.mark.parametrize(
    "overrides, replicated",
    [
        ([], []),
        (["parallel.tp=2", "parallel.replicate_indivisible_layers=true"], [1, 2]),  # the 3-head layers
        (["parallel.tp=4", "parallel.replicate_indivisible_layers=true"], [1, 2, 3, 4]),  # 3 and 6 heads
        (["parallel.tp=2", "schedule.heads=6x2,12x6", "parallel.replicate_indivisible_layers=true"], []),
        (["parallel.tp=2", "schedule.heads=6x2,12x6"], []),
    ],
)
def test_layer_plan_decides_replication_once(overrides, replicated):
    cfg = config.load("configs/tiny_prism.yaml", overrides)
    assert [layer.number for layer in cfg.layer_plan if layer.replicated] == replicated
    assert [layer.heads for layer in cfg.layer_plan] == list(cfg.heads_per_layer)
    assert [layer.head_dim * layer.heads for layer in cfg.layer_plan] == [cfg.model.d_model] * 8
    assert [layer.number for layer in cfg.layer_plan] == list(range(1, 9))


def test_the_config_carries_the_schedule_verdict_judged_with_its_replication_setting():
    cfg = config.load("configs/tiny_prism.yaml", ["parallel.tp=2", "parallel.replicate_indivisible_layers=true"])
    verdict = cfg.schedule_verdict
    assert verdict.heads == cfg.heads_per_layer and verdict.violations == () and verdict.errors == ()
    assert verdict.layers is cfg.layer_plan and [p.number for p in verdict.layers if p.replicated] == [1, 2]
    # a guideline broken with the config's permission is a warning the config carries, not an error
    with pytest.warns(UserWarning, match="allowed guideline 'staircase'"):
        ablation = config.load(
            "configs/tiny_prism.yaml", ["schedule.heads=3,6,12x6", "schedule.allow_guideline_violations=true"]
        )
    assert [v.rule for v in ablation.schedule_verdict.warnings] == ["staircase"]
    assert ablation.schedule_verdict.errors == ()


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
            "schedule.heads: schedule 3x2,6x2,12x4: rule 'tensor-parallel'",
        ),
        (
            lambda d: d["schedule"].update(heads="3x2,6x2,12x3"),
            "schedule.heads: lists 7 layers but model.num_layers=8",
        ),
        (lambda d: d["run"].update(arm="uniform"), "run.arm: 'uniform' needs a constant schedule"),
        (lambda d: d.pop("data"), "data: missing required key"),
        (lambda d: d["schedule"].update(heads="no-such-preset"), "schedule.heads: cannot read schedule part"),
        (lambda d: d["tracking"].update(milestones=["x"]), "tracking.milestones[0]: 'x' has the wrong type"),
        (
            lambda d: (
                d["parallel"].update(tp=2, replicate_indivisible_layers=True),
                d["model"].update(dropout=0.1),
            ),
            "model.dropout: 0.1: parallel.replicate_indivisible_layers needs model.dropout=0",
        ),
        (  # the per-layer plan divides by TP: range checks must run before it is built
            lambda d: d["parallel"].update(tp=0, replicate_indivisible_layers=True),
            "parallel.tp: 0 must be >= 1",
        ),
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
    assert cfg.steps(2) == {"total": 384, "warmup": 10, "grad_accum": 1, "main_total": 384, "decay": 0, "start": 0}
    assert cfg.steps(1)["grad_accum"] == 2
    with pytest.raises(ConfigError, match=r"256 x 4 x 3 = 3072"):
        cfg.steps(3)


def test_overrides_and_hash():
    base = config.load("configs/tiny_prism.yaml")
    over = config.load(
        "configs/tiny_prism.yaml", ["train.lr=3e-4", "schedule.heads=6x4,12x4", "tracking.milestones=[5.0]"]
    )
    assert over.train.lr == 3e-4 and over.heads_per_layer == (6,) * 4 + (12,) * 4 and over.tracking.milestones == (5.0,)
    assert base.hash() == config.load("configs/tiny_prism.yaml").hash()
    assert base.hash() != over.hash()
    with pytest.raises(ConfigError, match="write it as section.key=value"):
        config.load("configs/tiny_prism.yaml", ["train.lr"])
    with pytest.raises(ConfigError, match="train.nope: unknown key"):
        config.load("configs/tiny_prism.yaml", ["train.nope=1"])


@pytest.mark.parametrize(
    "key, bare, why, loaded",
    [
        ("train.eval_tasks", "piqa", "expected a list of str, got 'piqa'; write it as [piqa]", ("piqa",)),
        ("tracking.milestones", "5.0", "expected a list of float, got 5.0; write it as [5.0]", (5.0,)),
    ],
)
def test_a_list_key_given_one_value_says_how_to_write_the_list(key, bare, why, loaded):
    with pytest.raises(ConfigError) as e:
        config.load("configs/tiny_prism.yaml", [f"{key}={bare}"])
    assert str(e.value).endswith(f"{key}: {why}"), e.value
    section, name = key.split(".")  # the spelling it gives loads
    assert getattr(getattr(config.load("configs/tiny_prism.yaml", [f"{key}=[{bare}]"]), section), name) == loaded


def test_dump_round_trips_verbatim(tmp_path):
    cfg = config.load("configs/prism_124m.yaml", ["train.lr=1e-3"])
    p = tmp_path / "dumped.yaml"
    p.write_text(cfg.dump())
    again = config.load(p)
    assert again.to_dict() == cfg.to_dict() and again.hash() == cfg.hash()


def test_changed_keys_names_model_and_data_keys_only():
    a = config.load("configs/tiny_prism.yaml").to_dict()
    b = config.load(
        "configs/tiny_prism.yaml", ["model.ffn_hidden_size=528", "train.log_every=1", "data.tasks=4"]
    ).to_dict()
    assert config.changed_keys(a, b) == ["model.ffn_hidden_size"]
    # kernels and fusions run the same weights: a resume may switch them
    c = config.load("configs/tiny_prism.yaml", ["model.fusions=megatron", "model.attention_backend=math"]).to_dict()
    assert config.changed_keys(a, c) == []


def test_changed_keys_treats_a_key_newer_than_the_saved_config_as_its_default():
    """A checkpoint written before `model.spec` existed ran the local spec: resuming with the default is no change,
    asking for another spec is."""
    now = config.load("configs/tiny_prism.yaml").to_dict()
    saved = config.load("configs/tiny_prism.yaml").to_dict()
    del saved["model"]["spec"]
    assert config.schema_default("model.spec") == "local"
    assert config.changed_keys(saved, now) == []
    now["model"]["spec"] = "transformer_engine"
    assert config.changed_keys(saved, now) == ["model.spec"]


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        config.load(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        config.load(bad)

"""pipeline.compat: megatron-core 0.16.x / 0.19.x differences, and the copied DeepSpeed code behind its exact
version check. That the model builds under each megatron (0.19's TransformerLayer passes name=) is shown by
test_model.py, which both CI legs run; that the copied step equals DeepSpeed's own by
tests/integration/test_host_sync.py, the resume at another TP/DP size (DeepSpeed's universal checkpoint) by
tests/integration/test_elastic_resume.py."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from pipeline import compat
from pipeline.config import ConfigError

pytestmark = pytest.mark.megatron_compat


def test_an_unknown_argument_from_a_newer_megatron_is_an_error_naming_compat():
    with pytest.raises(TypeError, match=r"unknown argument\(s\) \['layer_spec_hint'\].*pipeline/compat/megatron.py"):
        compat.self_attention_extra_kwargs({"name": "decoder.layers.0.self_attention", "layer_spec_hint": 1})


# --- the copied DeepSpeed code runs on the release it mirrors only ---------------------------------------
@pytest.fixture
def deepspeed_release(monkeypatch):
    """Sets the installed DeepSpeed's version string; the one-warning flag starts unset."""
    deepspeed = compat.import_deepspeed()
    monkeypatch.setattr(compat.deepspeed, "_WARNED_FALLBACK", False)
    return lambda version: monkeypatch.setattr(deepspeed, "__version__", version)


def bare(cls):
    """An instance of a DeepSpeed optimizer wrapper with none of its attributes (never initialised)."""
    return object.__new__(cls)


def test_the_pin_is_the_mirrored_release():
    import re
    import tomllib

    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
    pins = [r for r in project["dependencies"] if re.match(r"deepspeed\b", r)]
    assert pins == [f"deepspeed=={compat.DEEPSPEED_MIRRORED}"]


@pytest.mark.parametrize("label", ["", "+a1b2c3d"])  # a source build of the release counts as the release
def test_on_the_mirrored_release_the_copied_step_is_chosen(deepspeed_release, label):
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    deepspeed_release(compat.DEEPSPEED_MIRRORED + label)
    # it reaches for the copy (and the bare wrapper lacks what the copy reads); that the installed copy steps
    # like DeepSpeed's own is checked on real engines in tests/integration/test_host_sync.py
    with pytest.raises(RuntimeError, match=r"compat/deepspeed.py sync_free_bf16_step: .* lacks"):
        compat.remove_host_syncs(bare(BF16_Optimizer))


def test_on_another_release_deepspeeds_own_step_runs_with_one_warning(deepspeed_release, caplog):
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    deepspeed_release("0.19.9")
    wrappers = [bare(BF16_Optimizer), bare(DeepSpeedZeroOptimizer), bare(BF16_Optimizer)]
    with caplog.at_level(logging.WARNING, logger="pipeline.compat.deepspeed"):
        for optimizer in wrappers:
            compat.remove_host_syncs(optimizer)
    assert all(vars(optimizer) == {} for optimizer in wrappers)  # nothing replaced: DeepSpeed's step and clip
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert "DeepSpeed 0.19.9 is installed" in lines[0] and f"deepspeed=={compat.DEEPSPEED_MIRRORED}" in lines[0]


# --- whether a DP change may resume is checkpoint's decision, not compat's ---------------------------------
def test_a_dp_change_without_zero_partitions_is_refused_by_the_resume_policy(tmp_path):
    from pipeline import checkpoint, config
    from pipeline.checkpoint import restore

    cfg = config.load(
        "configs/tiny_prism.yaml", [f"run.output_dir={tmp_path}", "parallel.zero_stage=0", "model.seq_len=64"]
    )
    tag = cfg.checkpoint_dir / checkpoint.tag_for(3)
    tag.mkdir(parents=True)
    (tag / checkpoint.MODEL_STATES).write_bytes(b"m" * 64)
    (tag / checkpoint.CONFIG_NAME).write_text(cfg.dump())
    checkpoint.write_integrity(tag, {"step": 3, "tp": 1, "dp_size": 2, "world_size": 2})
    (cfg.checkpoint_dir / checkpoint.LATEST).write_text(tag.name)
    with pytest.raises(ConfigError, match=r"saved at data-parallel size 2, this run has 1.*zero_stage 1 and 2"):
        restore.resume_point(cfg)  # a one-process run: DP 1

"""`model.spec: local | transformer_engine` (issue 12 item 2): the layer spec is a choice, never what imports.

No TransformerEngine is installed here: an importable TE is faked with empty modules in sys.modules, CUDA by
patching the model's device check, and megatron's TE spec builder is replaced by a recorder, so the tests
see which spec would be built without any TE code running.
"""

from __future__ import annotations

import sys
import types

import pytest
import yaml

from pipeline import config, distributed
from pipeline.config import ConfigError

PRESET = "configs/tiny_prism.yaml"


@pytest.fixture
def te_importable_on_cuda(monkeypatch):
    """A host where `import transformer_engine.pytorch` succeeds and the train device is CUDA; returns the
    list of calls to megatron's TE spec builder."""
    from megatron.core.models.gpt import gpt_layer_specs

    from pipeline.model import gpt

    te = types.ModuleType("transformer_engine")
    te.pytorch = types.ModuleType("transformer_engine.pytorch")
    monkeypatch.setitem(sys.modules, "transformer_engine", te)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", te.pytorch)
    monkeypatch.setattr(gpt, "use_cuda", lambda cfg: True)
    calls = []

    def te_spec(*args, **kwargs):
        calls.append("transformer_engine")
        return gpt_layer_specs.get_gpt_layer_local_spec()  # a real spec, so the rest of layer_spec runs

    monkeypatch.setattr(gpt_layer_specs, "get_gpt_layer_with_transformer_engine_spec", te_spec)
    return calls


def test_local_spec_is_used_even_where_transformer_engine_imports(te_importable_on_cuda):
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from pipeline.model.gpt import layer_spec

    spec = layer_spec(config.load(PRESET))  # default model.spec: local
    assert te_importable_on_cuda == []
    assert spec.submodules.self_attention.submodules.linear_qkv is ColumnParallelLinear


def test_transformer_engine_spec_is_built_when_asked_for_and_importable(te_importable_on_cuda):
    from pipeline.model.gpt import layer_spec

    layer_spec(config.load(PRESET, ["model.spec=transformer_engine"]))
    assert te_importable_on_cuda == ["transformer_engine"]


def test_transformer_engine_refused_in_one_line_where_it_does_not_import(monkeypatch):
    from pipeline.model import gpt

    monkeypatch.setitem(sys.modules, "transformer_engine", None)  # import raises ImportError
    monkeypatch.setattr(gpt, "use_cuda", lambda cfg: True)
    cfg = config.load(PRESET, ["model.spec=transformer_engine"])
    with pytest.raises(ConfigError, match=r"model.spec: transformer_engine does not import here \(") as e:
        gpt.check_spec(cfg)
    assert "model.spec=local" in str(e.value) and "\n" not in str(e.value)
    assert gpt.check_spec(config.load(PRESET)) == "local"


def test_resume_across_specs_is_refused_naming_both(tmp_path):
    from pipeline import checkpoint
    from pipeline.checkpoint import restore

    cfg = config.load(PRESET, [f"checkpoint.dir={tmp_path}"])
    (tmp_path / "step-0000002").mkdir()
    (tmp_path / "step-0000002" / "config.yaml").write_text(cfg.dump())
    (tmp_path / "step-0000002" / checkpoint.MODEL_STATES).write_bytes(b"")
    checkpoint.write_integrity(tmp_path / "step-0000002", {"step": 2, "tp": 1, "dp_size": 1, "world_size": 1})
    (tmp_path / "latest").write_text("step-0000002")
    assert restore.resume_point(cfg).tag == "step-0000002"
    other = config.load(PRESET, [f"checkpoint.dir={tmp_path}", "model.spec=transformer_engine"])
    with pytest.raises(ConfigError, match=r"model.spec changed \('local' -> 'transformer_engine'\)"):
        restore.resume_point(other)
    assert yaml.safe_load(cfg.dump())["model"]["spec"] == "local"  # the checkpoint's config records it


def test_a_save_records_the_spec_where_the_resume_reads_it(tmp_path):
    """The spec is part of the weights' layout (TE fuses norms, adds _extra_state): a save writes it in the
    tag's config.yaml, and the resume policy refuses another spec from there, before any weights load."""
    from pipeline.checkpoint import restore
    from pipeline.checkpoint.writer import Saver

    class Engine:  # what a synchronous save touches of a DeepSpeed engine: it writes the tag's files
        def save_checkpoint(self, save_dir, tag, client_state, save_latest):
            (tmp_path / tag).mkdir(parents=True, exist_ok=True)
            (tmp_path / tag / "mp_rank_00_model_states.pt").write_bytes(b"weights")
            self.client_state = client_state

    cfg = config.load(PRESET, [f"checkpoint.dir={tmp_path}", "checkpoint.async_save=false"])
    distributed.init_model_parallel(1, cfg.run.seed)  # the save asks megatron for the data-parallel layout
    engine = Engine()
    Saver(engine, cfg, "cpu").save(restore.TrainState(step=2))
    assert (tmp_path / "latest").read_text() == "step-0000002"
    assert yaml.safe_load((tmp_path / "step-0000002" / "config.yaml").read_text())["model"]["spec"] == "local"
    assert set(engine.client_state["prism"]) == {"step", "ranks", "skips"}  # what restore.load reads
    other = config.load(PRESET, [f"checkpoint.dir={tmp_path}", "model.spec=transformer_engine"])
    with pytest.raises(ConfigError, match=r"model.spec changed \('local' -> 'transformer_engine'\)"):
        restore.resume_point(other)

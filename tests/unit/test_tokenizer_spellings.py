"""`prism eval` and `prism attention-distance` take data.tokenizer in the spellings `prism prepare` takes (a
tokenizer.json path, a Hub name such as gpt2, or the tokenizer the dataset's manifest recorded), and refuse
with one line before the model loads when it cannot be used."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pipeline import config, inference
from pipeline.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def cfg_with(tiny_data, *extra: str) -> config.Config:
    return config.load(ROOT / "configs" / "tiny_prism.yaml", [*tiny_data.overrides, *extra])


def test_a_tokenizer_file_is_used_as_is(tiny_data):
    assert inference.tokenizer_file(cfg_with(tiny_data)) == tiny_data.tokenizer


def test_a_missing_file_falls_back_to_the_tokenizer_the_manifest_recorded(tiny_data, tmp_path):
    cfg = cfg_with(tiny_data, f"data.tokenizer={tmp_path / 'moved' / 'tokenizer.json'}")
    assert inference.tokenizer_file(cfg) == tiny_data.tokenizer
    tok, eos = inference.load_tokenizer(cfg)
    assert tok.get_vocab_size() == 8192 and eos == tok.token_to_id("<|endoftext|>")


def test_a_hub_name_is_found_in_the_hf_cache_offline(tiny_data, tmp_path, monkeypatch):
    from huggingface_hub import constants

    # The HF cache layout hf_hub_download reads: refs/main names a snapshot holding tokenizer.json.
    repo = tmp_path / "hub" / "models--gpt2"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    (repo / "snapshots" / ("0" * 40)).mkdir(parents=True)
    shutil.copy(tiny_data.tokenizer, repo / "snapshots" / ("0" * 40) / "tokenizer.json")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = cfg_with(tiny_data, "data.tokenizer=gpt2", f"data.dataset_dir={tmp_path / 'none'}")
    assert inference.tokenizer_file(cfg).read_bytes() == tiny_data.tokenizer.read_bytes()


def test_an_unresolvable_spelling_is_one_line_naming_it(tiny_data, tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for spelling, says in (("gpt2", "unreachable"), (str(tmp_path / "nope.json"), "not found")):
        cfg = cfg_with(tiny_data, f"data.tokenizer={spelling}", f"data.dataset_dir={tmp_path / 'none'}")
        with pytest.raises(ConfigError) as e:
            inference.tokenizer_file(cfg)
        assert f"data.tokenizer={spelling}" in str(e.value) and says in str(e.value) and "\n" not in str(e.value)

"""`prism eval` and `prism attention-distance` on a real checkpoint: a tokenizer spelling that cannot be used is
one line before the model loads; the spellings `prism prepare` accepts go on to load it."""

from __future__ import annotations

import pytest

from pipeline import inference


class ModelLoaded(Exception):
    """Raised by the patched load_checkpoint: the verb got as far as loading the model."""


@pytest.fixture
def no_model(monkeypatch):
    def refuse(*args, **kwargs):
        raise ModelLoaded

    monkeypatch.setattr(inference, "load_checkpoint", refuse)


def test_eval_refuses_an_unusable_tokenizer_before_the_model_loads(tiny_checkpoints, tmp_path, no_model, capsys):
    from pipeline.cli import main

    bad = [f"data.tokenizer={tmp_path / 'nope.json'}", f"data.dataset_dir={tmp_path / 'none'}"]
    assert main(["eval", str(tiny_checkpoints.prism), *bad, "--limit", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "data.tokenizer=" in err[0] and "not found" in err[0]
    # A Hub-name spelling the machine cannot fetch falls back to the manifest's tokenizer and goes on to load.
    with pytest.raises(ModelLoaded):
        main(["eval", str(tiny_checkpoints.prism), "data.tokenizer=gpt2", "--limit", "1"])


def test_attention_distance_refuses_a_dataset_of_another_tokenizer_before_the_model_loads(
    tiny_checkpoints, no_model, capsys
):
    from pipeline.cli import main

    assert main(["attention-distance", str(tiny_checkpoints.prism), "data.tokenizer=gpt2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'gpt2'" in err[0] and "tokenizer" in err[0]
    with pytest.raises(ModelLoaded):  # the run's own tokenizer spelling: on to the model
        main(["attention-distance", str(tiny_checkpoints.prism), "--sequences", "1"])

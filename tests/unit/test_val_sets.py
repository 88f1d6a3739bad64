"""Named validation sets (data.val_sets) on the session's tiny data: what `prepare` builds for the tiny preset's
held-out set, which rows each set scores, and the checks every set passes before step 1 (one line naming the
set's key)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pipeline import config, data
from pipeline.dataset import DataError

ROOT = Path(__file__).resolve().parents[2]


def load(tiny_data, *extra: str) -> config.Config:
    return config.load(ROOT / "configs" / "tiny_prism.yaml", [*tiny_data.overrides, *extra])


def test_the_held_out_set_is_unseen_text_tokenized_like_the_run(tiny_data):
    held = json.loads((tiny_data.heldout_dir / "manifest.json").read_text())
    assert held["tokenizer"]["sha256"] == tiny_data.manifest["tokenizer"]["sha256"]
    assert held["seq_len"] == tiny_data.manifest["seq_len"] == 128
    assert not held["splits"]["train"]["shards"] and held["splits"]["val"]["shards"]  # every document to val
    import pyarrow.parquet as pq

    def ids(folder: Path) -> set[str]:
        return set(pq.ParquetDataset(folder).read(columns=["id"]).column("id").to_pylist())

    assert ids(tiny_data.heldout_corpus) and not ids(tiny_data.heldout_corpus) & ids(tiny_data.corpus_dir)


def test_each_set_scores_its_own_fixed_rows_and_is_named_by_its_metric(tiny_data):
    cfg = load(tiny_data, "train.val_tokens=2048", "data.val_sets.heldout.tokens=1024")
    own, held = cfg.validation_sets()
    assert (own.metric, held.metric) == ("val/loss", "val/heldout/loss")
    manifests = data.checked_val_manifests(cfg, data.checked_manifest(cfg))
    rows = {vs.metric: data.load_val_tokens(cfg, manifests[vs.metric], vs) for vs in cfg.validation_sets()}
    assert rows["val/loss"].shape == (16, 129) and rows["val/heldout/loss"].shape == (8, 129)
    assert (rows["val/loss"] == data.load_val_tokens(cfg)).all()  # the default set is what it always was
    assert not (rows["val/loss"][:8] == rows["val/heldout/loss"]).all()


def test_a_run_may_change_its_validation_sets_on_resume(tiny_data):
    before, after = load(tiny_data), load(tiny_data, "data.val_sets={}")
    assert config.changed_keys(before.to_dict(), after.to_dict()) == []


def break_copy(tiny_data, tmp_path: Path, **manifest_changes) -> Path:
    copy = tmp_path / "heldout"
    shutil.copytree(tiny_data.heldout_dir, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    for key, value in manifest_changes.items():
        section, _, name = key.partition("__")
        (manifest[section] if name else manifest)[name or section] = value
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({}, r"^data\.val_sets\.heldout\.dataset_dir: .*/gone/manifest\.json: no manifest"),
        (
            {"tokenizer__sha256": "0" * 64},
            r"^data\.val_sets\.heldout\.dataset_dir: .*different tokenizer .*; re-prepare data\.val_sets\.heldout "
            r"with the run's data\.tokenizer$",
        ),
        (
            {"seq_len": 64},
            r"^data\.val_sets\.heldout\.dataset_dir: .*dataset seq_len=64 but model\.seq_len=128; re-prepare "
            r"data\.val_sets\.heldout with the run's model\.seq_len$",
        ),
    ],
)
def test_a_set_of_another_tokenizer_a_shorter_seq_len_or_no_folder_is_one_line(tiny_data, tmp_path, change, message):
    folder = break_copy(tiny_data, tmp_path, **change) if change else tmp_path / "gone"
    cfg = load(tiny_data, f"data.val_sets.heldout.dataset_dir={folder}")
    with pytest.raises(DataError, match=message) as raised:
        data.checked_val_manifests(cfg, data.checked_manifest(cfg))
    assert "\n" not in str(raised.value)


def test_a_split_without_rows_and_a_bad_name_are_refused(tiny_data):
    cfg = load(tiny_data, "data.val_sets.heldout.split=train")
    with pytest.raises(DataError, match=r"^data\.val_sets\.heldout\.split: the train split of .* is empty"):
        data.checked_val_manifests(cfg, data.checked_manifest(cfg))
    with pytest.raises(config.ConfigError, match=r"data\.val_sets\.a b: 'a b' is not a plain name"):
        load(tiny_data, "data.val_sets={'a b': {dataset_dir: x}}")

"""`prepare` runs of their own on real datatrove executors (worker pools, a killed process): identical bytes
from a second build, resume after a kill, a rebuild with --overwrite, JSONL input."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer

from data_prep.build import prepare
from data_prep.manifest import verify
from pipeline import config
from pipeline.dataset import DataError

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny_prism.yaml"


def load(tiny_data, *extra: str) -> config.Config:
    return config.load(TINY, tiny_data.overrides + list(extra))


def one_line_refusal(cfg: config.Config, match: str, **kw) -> str:
    with pytest.raises(DataError, match=match) as e:
        prepare(cfg, **kw)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_same_input_gives_identical_bytes_and_a_done_folder_is_left_alone(tiny_data, tmp_path, capsys):
    again = prepare(load(tiny_data, f"data.dataset_dir={tmp_path / 'again'}"), quiet=True)
    assert again.read_bytes() == (tiny_data.dataset_dir / "manifest.json").read_bytes()
    for shard in tiny_data.manifest["splits"]["train"]["shards"]:
        assert (tmp_path / "again" / shard["path"]).read_bytes() == (tiny_data.dataset_dir / shard["path"]).read_bytes()
    # A finished dataset of the same data config is reused, even with another task count (execution key).
    before = again.stat().st_mtime_ns
    assert prepare(load(tiny_data, f"data.dataset_dir={tmp_path / 'again'}", "data.tasks=3")) == again
    assert "up to date" in capsys.readouterr().out and again.stat().st_mtime_ns == before


# --- resume after a killed run --------------------------------------------------------------------------
RUNNER = (
    "import sys; from pipeline import config; from data_prep.build import prepare; "
    "prepare(config.load(sys.argv[1], sys.argv[2:]))"
)


def test_kill_then_rerun_equals_a_clean_run(tiny_data, tmp_path):
    # Small shards and one worker: task 1 writes many shards after task 0 completed, so the kill lands mid-task.
    # No held-out set: prepare would build it with these shard sizes too, into the fixture's folder.
    common = ["data.samples_per_shard=1", "data.val_samples_per_shard=1", "data.workers=1", "data.val_sets={}"]
    killed_dir = tmp_path / "killed"
    args = [
        sys.executable,
        "-c",
        RUNNER,
        str(TINY),
        *tiny_data.overrides,
        *common,
        f"data.dataset_dir={killed_dir}",
    ]
    proc = subprocess.Popen(
        args, cwd=ROOT, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    first_of_task1 = killed_dir / "train" / "shard-00001-000000.tar"
    deadline = time.monotonic() + 120
    while not first_of_task1.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.001)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    completions = killed_dir / ".prep" / "logs" / "completions"
    assert (completions / "00000").exists() and not (completions / "00001").exists(), "kill missed task 1"
    assert not (killed_dir / "manifest.json").exists()
    assert first_of_task1.exists()  # task 1 left partial output behind
    # An unfinished build resumes only with the same task count (it fixes the shard layout).
    with pytest.raises(DataError, match="data.tasks=2"):
        prepare(load(tiny_data, *common, f"data.dataset_dir={killed_dir}", "data.tasks=3"))

    task0 = {p.name: p.stat().st_mtime_ns for p in (killed_dir / "train").glob("shard-00000-*")}
    resumed = prepare(load(tiny_data, *common, f"data.dataset_dir={killed_dir}"), quiet=True)
    assert {p.name: p.stat().st_mtime_ns for p in (killed_dir / "train").glob("shard-00000-*")} == task0  # skipped
    clean = prepare(load(tiny_data, *common, f"data.dataset_dir={tmp_path / 'clean'}"), quiet=True)
    assert resumed.read_bytes() == clean.read_bytes()
    assert verify(killed_dir) == []
    assert not [p for p in killed_dir.rglob("*") if p.name.endswith(".tmp")]  # pipeline.atomic temp names


def test_refuses_a_folder_of_another_config_unless_overwrite(tiny_data, tmp_path):
    msg = one_line_refusal(load(tiny_data, "data.val_fraction=0.1"), "another data config")
    assert "data.val_fraction" in msg and "--overwrite" in msg
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    one_line_refusal(load(tiny_data, f"data.dataset_dir={tmp_path / 'foreign'}"), "not a Prism dataset")
    one_line_refusal(load(tiny_data, f"data.dataset_dir={tmp_path / 'foreign'}"), "not a Prism dataset", overwrite=True)
    assert (tmp_path / "foreign" / "notes.txt").read_text() == "mine"

    copy = tmp_path / "copy"
    shutil.copytree(tiny_data.dataset_dir, copy)
    rebuilt = prepare(load(tiny_data, f"data.dataset_dir={copy}", "data.val_fraction=0.1"), overwrite=True, quiet=True)
    m = json.loads(rebuilt.read_text())
    assert m["config"]["data.val_fraction"] == 0.1
    assert m["totals"]["documents"] == tiny_data.manifest["totals"]["documents"]
    assert len(m["splits"]["val"]["shards"]) > len(tiny_data.manifest["splits"]["val"]["shards"])
    assert verify(copy) == []


def test_jsonl_input(tiny_data, tmp_path):
    (tmp_path / "in").mkdir()
    texts = pq.read_table(sorted(tiny_data.corpus_dir.glob("*.parquet"))[0]).column("text").to_pylist()
    with open(tmp_path / "in" / "docs.jsonl", "w") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({"text": text, "id": f"doc-{i}"}) + "\n")
    cfg = load(
        tiny_data,
        f"data.input={tmp_path / 'in'}",
        "data.input_format=jsonl",
        "data.tasks=1",
        f"data.dataset_dir={tmp_path / 'out'}",
        "data.samples_per_shard=4",
        "data.val_sets={}",  # the held-out set's input is parquet; this run reads JSONL
    )
    m = json.loads(prepare(cfg, quiet=True).read_text())
    tok = Tokenizer.from_file(str(tiny_data.tokenizer))
    tok.encode_special_tokens = True
    assert m["totals"]["tokens_encoded"] == sum(
        len(e.ids) + 1 for e in tok.encode_batch(texts, add_special_tokens=False)
    )
    assert m["totals"]["documents"] == len(texts) and m["splits"]["train"]["shards"]

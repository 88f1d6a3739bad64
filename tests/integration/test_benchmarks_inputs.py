"""A benchmark given a missing input says so in one line and exits 2, without a traceback."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_bench(script: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, f"benchmarks/{script}", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    ("script", "args", "names"),
    [
        ("bench_train.py", ["configs/tiny_prism.yaml", "data.dataset_dir={tmp}/none"], "no manifest.json"),
        (
            "bench_tokenize.py",
            [
                "--config",
                "configs/tiny_prism.yaml",
                "data.input={tmp}",
                "data.input_format=parquet",
                "data.tokenizer={tmp}/none.json",
            ],
            "tokenizer file not found",
        ),
    ],
)
def test_missing_input_is_one_line_and_exit_2(tmp_path, script, args, names):
    import pyarrow as pa
    import pyarrow.parquet as pq

    # an input folder that is valid; the tokenizer file is not there
    pq.write_table(pa.table({"text": ["some text"], "id": ["a"]}), tmp_path / "corpus.parquet")
    proc = run_bench(script, *(a.format(tmp=tmp_path) for a in args))
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(script.removesuffix(".py") + ": ") and names in lines[0]
    assert "Traceback" not in proc.stdout + proc.stderr

"""The terminal shows prism's lines only: megatron's TE/Apex warnings and datatrove's per-task log and stats
blocks go to <run.output_dir>/logs/prism-VERB.log; --verbose brings them back to the terminal."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "default"}
ENV.pop("PRISM_LOG_FILE", None)
ENV.pop("PRISM_VERBOSE", None)


def prism(*argv: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pipeline.cli", *argv]
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)


def test_megatron_warnings_go_to_the_log_file_unless_verbose(tmp_path):
    quiet = prism("model", "report", "configs/tiny_prism.yaml", f"run.output_dir={tmp_path}")
    assert quiet.returncode == 0, quiet.stderr[-2000:]
    assert "neutral: yes" in quiet.stdout
    assert "Warning" not in quiet.stderr and "warnings.warn" not in quiet.stderr, quiet.stderr[-2000:]
    log = (tmp_path / "logs" / "prism-model.log").read_text()
    assert "Apex is not installed" in log  # moved, not lost

    loud = prism("model", "report", "configs/tiny_prism.yaml", f"run.output_dir={tmp_path / 'v'}", "--verbose")
    assert loud.returncode == 0 and "Apex is not installed" in loud.stderr
    assert not (tmp_path / "v" / "logs").exists()


def test_datatrove_task_logs_and_stats_stay_off_the_terminal(tiny_data, tmp_path):
    args = [
        "prepare",
        "configs/tiny_prism.yaml",
        *tiny_data.overrides,
        f"data.dataset_dir={tmp_path / 'ds'}",
        f"run.output_dir={tmp_path}",
        "data.workers=1",
    ]
    quiet = prism(*args)
    assert quiet.returncode == 0, quiet.stderr[-2000:]
    printed = quiet.stdout + quiet.stderr
    assert "Stats" not in printed and "datatrove" not in quiet.stderr and "Launching pipeline" not in printed
    assert "prism prepare: tokenising into shards with datatrove" in quiet.stdout
    assert "Stats: All" in (tmp_path / "logs" / "prism-prepare.log").read_text()

    loud = prism(*args[:-3], f"data.dataset_dir={tmp_path / 'ds2'}", f"run.output_dir={tmp_path}", "--verbose")
    assert loud.returncode == 0 and "Stats" in loud.stderr

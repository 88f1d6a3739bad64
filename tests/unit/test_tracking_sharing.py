"""Sharing and secrets (issue 14 item 10): write-then-rename honours the umask; tracking-URI credentials are
never written or logged in clear."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.atomic import write_atomic

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_write_atomic_gives_files_the_mode_the_umask_allows(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        write_atomic(tmp_path / "manifest.json", "{}")
        plain = tmp_path / "plain"
        plain.write_text("x")  # what open() makes under the same umask
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "manifest.json").stat().st_mode) == mode == stat.S_IMODE(plain.stat().st_mode)


def test_a_dataset_prepared_under_umask_002_is_group_writable_and_world_readable(tmp_path):
    # A real process with its own umask, through data_prep's writers (tokenizer file written via rename).
    code = (
        "import os, sys; os.umask(0o002);"
        "from data_prep.corpus import build_embedded_corpus, train_bpe_tokenizer;"
        "c = build_embedded_corpus(sys.argv[1] + '/corpus', max_bytes=200_000, num_files=2);"
        "train_bpe_tokenizer(c, sys.argv[1] + '/bpe.json', vocab_size=300, eos_token='<|endoftext|>')"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, env=env, timeout=300)
    for f in [tmp_path / "bpe.json", *(tmp_path / "corpus").iterdir()]:
        assert stat.S_IMODE(f.stat().st_mode) == 0o664, f

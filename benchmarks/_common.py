"""What the benchmarks share: the tiny dataset they build on a fresh clone, flushed progress lines, the one-line
refusal of a missing input, and the `BENCH name {json}` line that `benchmarks/check_quick.py` reads.

The tiny dataset is the test fixture's recipe (tests/fixtures/tiny_data.py): a slice of the embedded corpus,
an 8k BPE trained on it, and `prepare` at seq_len 128, built from data_prep's own functions in ~10 s.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CACHE = ROOT / "runs" / "bench"  # corpora and tokenizers reused by later runs (runs/ is git-ignored)
EOS = "<|endoftext|>"
_START = time.perf_counter()


def say(*parts) -> None:
    """A progress line, flushed at once (the output may be a pipe), with the seconds since start."""
    print(f"[{time.perf_counter() - _START:6.1f}s]", *parts, flush=True)


def announce(module: str, doc: str) -> None:
    """Run as a script: print the docstring's first line (what is measured) before torch or datatrove load,
    which takes tens of seconds on a busy machine."""
    if module == "__main__":
        say(doc.strip().splitlines()[0])


def refuse(prog: str, message: str) -> None:
    """A missing or bad input: one line naming the cause and the fix, exit 2, no traceback."""
    print(f"{prog}: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def report(name: str, fields: dict) -> None:
    """The last line of a benchmark: every figure it measured, for people and for check_quick.py."""
    print(f"BENCH {name} {json.dumps(fields)}", flush=True)


def quiet_datatrove() -> None:
    """datatrove logs every task to stderr; its per-task logs still go to the dataset's .prep/logs."""
    from datatrove.utils.logging import logger

    logger.remove()


def embedded_corpus(megabytes: float, files: int = 8) -> Path:
    """A cached slice of the embedded corpus (FineWeb-schema parquet), built on first use."""
    from data_prep.corpus import build_embedded_corpus

    out = CACHE / f"corpus-{megabytes:g}mb-{files}f"
    if not out.exists():
        say(f"building a {megabytes:g} MB embedded corpus -> {out}")
        build_embedded_corpus(out, max_bytes=int(megabytes * 1e6), num_files=files)
    return out


def bpe_tokenizer(corpus: Path, vocab_size: int = 8192) -> Path:
    """An 8k byte-level BPE trained on ``corpus`` (cached next to it)."""
    from data_prep.corpus import train_bpe_tokenizer

    out = corpus.with_name(f"{corpus.name}-bpe{vocab_size // 1024}k.json")
    if not out.exists():
        say(f"training a {vocab_size}-entry BPE on {corpus.name} -> {out}")
        train_bpe_tokenizer(corpus, out, vocab_size=vocab_size, eos_token=EOS)
    return out


def tiny_dataset(out: Path, megabytes: float = 2.5, seq_len: int = 128) -> list[str]:
    """Prepare the tiny dataset into ``out`` (reused when it is already there); returns the config overrides
    (data.dataset_dir, data.tokenizer, data.input, model.seq_len) that point configs/tiny_prism.yaml at it."""
    from data_prep.build import prepare
    from pipeline import config

    corpus = embedded_corpus(megabytes)
    overrides = [
        f"data.dataset_dir={out}",
        f"data.tokenizer={bpe_tokenizer(corpus)}",
        f"data.input={corpus}",
        "data.input_format=parquet",
        f"model.seq_len={seq_len}",
        "data.val_sets={}",  # the preset's held-out set is built from the embedded input only; not timed here
    ]
    say(f"preparing the tiny dataset -> {out}")
    quiet_datatrove()
    prepare(config.load(ROOT / "configs" / "tiny_prism.yaml", overrides), quiet=True)
    return overrides

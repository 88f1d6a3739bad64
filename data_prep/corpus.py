"""The embedded offline corpus: FineWeb-schema parquet files built from English text installed with Python.

Each document is the docstrings of one Python source file (module, class and function docstrings, in source
order), read with ``ast`` so nothing is imported; the standard library's pydoc topics come first. Sources are
visited in sorted order, so the same installation always yields the same bytes. Nothing of it is committed.
"""

from __future__ import annotations

import ast
import hashlib
import os
import shutil
import sys
import sysconfig
from collections import deque
from collections.abc import Iterator
from pathlib import Path

from pipeline.atomic import write_atomic

# FineWeb's columns and types (sample/10BT), in its order.
FINEWEB_SCHEMA = (
    ("text", "string"),
    ("id", "string"),
    ("dump", "string"),
    ("url", "string"),
    ("date", "string"),
    ("file_path", "string"),
    ("language", "string"),
    ("language_score", "float64"),
    ("token_count", "int64"),
)
DUMP = "PRISM-EMBEDDED-1"
DATE = "2026-01-01T00:00:00Z"  # fixed: the corpus must be byte-reproducible
MIN_DOC_CHARS = 200  # shorter files (one-line docstrings) are noise, not prose
SKIP_DIRS = {"test", "tests", "testing", "__pycache__", "idle_test", "site-packages", "lib2to3"}


def _docstrings(source: str) -> list[str]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    out = []
    todo = deque([tree])  # ast.walk's breadth-first order, without entering expressions: none holds a def
    while todo:
        node = todo.popleft()
        todo.extend(child for child in ast.iter_child_nodes(node) if not isinstance(child, ast.expr))
        if isinstance(node, kinds) and (doc := ast.get_docstring(node, clean=True)):
            out.append(doc)
    return out


def _python_files(root: Path) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield Path(dirpath) / name


def iter_documents() -> Iterator[tuple[str, str]]:
    """Yield (source name, text): pydoc topics, then stdlib docstrings, then the installed packages'."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip pydoc_data
        topics = {}
    for name in sorted(topics):
        if len(topics[name]) >= MIN_DOC_CHARS:
            yield f"pydoc-topics/{name}", topics[name]
    roots = [("stdlib", Path(sysconfig.get_paths()["stdlib"]))]
    purelib = Path(sysconfig.get_paths()["purelib"])
    if purelib.is_dir() and sys.prefix != sys.base_prefix:  # the venv's packages, not the system's
        roots.append(("site-packages", purelib))
    for label, root in roots:
        for path in _python_files(root):
            try:
                source = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            text = "\n\n".join(_docstrings(source))
            if len(text) >= MIN_DOC_CHARS:
                yield f"{label}/{path.relative_to(root).as_posix()}", text


def build_embedded_corpus(out_dir: str | Path, max_bytes: int = 8_000_000, num_files: int = 8) -> Path:
    """Write ``num_files`` parquet files (FineWeb columns) holding about ``max_bytes`` of UTF-8 text.

    The folder appears atomically: files are written to a temporary sibling folder that is renamed last.
    """
    return build_embedded_corpora([(out_dir, max_bytes, num_files)])[0]


def build_embedded_corpora(slices: list[tuple[str | Path | None, int, int]]) -> list[Path | None]:
    """Consecutive slices of the embedded text in one walk, each ``(out_dir, max_bytes, num_files)`` written
    as build_embedded_corpus writes one (an out_dir of None: the slice is skipped). So a held-out corpus (a
    validation set's, data.val_sets) is the text right after the training corpus: none of its documents are
    trained on, and building both costs one walk."""
    documents = iter_documents()
    written: list[Path | None] = []
    for out_dir, max_bytes, num_files in slices:
        docs: list[tuple[str, str]] = []
        total = 0
        for source, text in documents:
            docs.append((source, text))
            total += len(text.encode("utf-8"))
            if total >= max_bytes:
                break
        written.append(None if out_dir is None else _write_corpus(Path(out_dir), docs, total, num_files))
    return written


def _write_corpus(out_dir: Path, docs: list[tuple[str, str]], total: int, num_files: int) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    # Interleave sources (a stable hash of the name, not the sorted walk): otherwise each file, shard and
    # training batch holds one package's docstrings and the model sees a different dialect every step.
    docs.sort(key=lambda doc: hashlib.sha256(doc[0].encode()).digest())
    if len(docs) < num_files:
        raise ValueError(f"only {len(docs)} documents of embedded text found; cannot build {num_files} files")

    schema = pa.schema([(name, getattr(pa, kind)()) for name, kind in FINEWEB_SCHEMA])
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    # Contiguous runs of documents, balanced by bytes, so every file (and so every reader task) has work.
    bounds = [0]
    acc = 0
    for i, (_, text) in enumerate(docs):
        acc += len(text.encode("utf-8"))
        if acc >= total * len(bounds) / num_files and len(bounds) < num_files:
            bounds.append(i + 1)
    bounds.append(len(docs))
    for f in range(num_files):
        part = docs[bounds[f] : bounds[f + 1]]
        columns = {
            "text": [t for _, t in part],
            "id": [f"<urn:prism:embedded:{s}>" for s, _ in part],
            "dump": [DUMP] * len(part),
            "url": [f"python://{s}" for s, _ in part],
            "date": [DATE] * len(part),
            "file_path": [s for s, _ in part],
            "language": ["en"] * len(part),
            "language_score": [1.0] * len(part),
            "token_count": [len(t.split()) for _, t in part],  # whitespace words: no GPT-2 BPE offline
        }
        pq.write_table(pa.table(columns, schema=schema), tmp / f"corpus-{f:05d}.parquet")
    if out_dir.exists():  # a concurrent builder won the race: keep its (identical) folder
        shutil.rmtree(tmp)
    else:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, out_dir)
    return out_dir


def train_bpe_tokenizer(corpus_dir: str | Path, out_path: str | Path, vocab_size: int, eos_token: str) -> Path:
    """Train a byte-level BPE (HF ``tokenizers``) on the corpus' text column; written via temp + rename."""
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files = sorted(Path(corpus_dir).glob("*.parquet"))
    if not files:
        raise ValueError(f"{corpus_dir}: no parquet files to train the tokenizer on")

    def texts() -> Iterator[str]:
        for f in files:
            yield from pq.read_table(f, columns=["text"]).column("text").to_pylist()

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[eos_token],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts(), trainer=trainer)
    out_path = Path(out_path)
    write_atomic(out_path, tok.to_str())
    return out_path

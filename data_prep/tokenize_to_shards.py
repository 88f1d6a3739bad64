"""The datatrove step that tokenises documents, packs them into fixed-length sequences and writes shards
in the format pipeline/dataset.py defines.

One task's output is a deterministic function of its input files: documents are read in file order,
routed to train or val by a stable hash of their id, encoded with EOS appended, concatenated into one token
stream per split and cut into rows of ``seq_len + 1`` tokens. Rows group into samples (one tar member each)
and samples into shards. End-of-task rule: only whole shards are written; the tokens that do not fill one at
the end of a task (at most one shard's worth per split) are dropped and counted.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from datatrove.data import DocumentsPipeline
from datatrove.utils.batching import batched
from datatrove.utils.tokenization import PipelineStepWithTokenizer

from data_prep.manifest import rank_record
from data_prep.steps import NoPackageScan
from pipeline.atomic import write_atomic
from pipeline.dataset import DTYPES, SAMPLE_SUFFIX, SPLITS, shard_key, shard_name

TAR_MTIME = 0  # fixed tar metadata: shards are byte-reproducible
TAR_OWNER = "prism"


def is_val(doc_id: str, val_fraction: float) -> bool:
    """Stable per-document split: the first 8 bytes of sha256(id) as a fraction of 2**64."""
    h = int.from_bytes(hashlib.sha256(doc_id.encode("utf-8")).digest()[:8], "big")
    return h < val_fraction * 2**64


def encode_tar(samples: np.ndarray, key_prefix: str) -> bytes:
    """One webdataset tar: member ``<key>.tokens`` per sample, raw C-order bytes, fixed metadata.

    The same members webdataset's TarWriter writes (ustar, mode 0o444), built with tarfile directly:
    importing webdataset imports torch, seconds per task on a CPU node for nothing.
    """
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i, sample in enumerate(samples):
            data = sample.tobytes()
            info = tarfile.TarInfo(f"{key_prefix}-{i:06d}{SAMPLE_SUFFIX}")
            info.size, info.mtime, info.mode = len(data), TAR_MTIME, 0o444
            info.uname = info.gname = TAR_OWNER
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


class _SplitPacker:
    """Token stream of one split in one task, documents joined with EOS; emits a shard whenever a whole one is
    buffered."""

    def __init__(self, split, rank, out_dir, seq_len, sequences_per_sample, samples_per_shard, dtype, eos_id):
        self.split, self.rank, self.out_dir, self.eos_id = split, rank, out_dir, eos_id
        self.shape = (samples_per_shard, sequences_per_sample, seq_len + 1)
        self.shard_tokens = int(np.prod(self.shape))
        self.dtype = DTYPES[dtype]
        self.pending: list[np.ndarray] = []
        self.pending_len = 0
        self.shards: list[dict] = []
        self.documents = 0
        self.tokens_encoded = 0

    def add(self, ids: list[int]) -> int:
        """One document's ids (a list of the caller's, extended in place with EOS); returns its token count."""
        ids.append(self.eos_id)
        self.documents += 1
        self.tokens_encoded += len(ids)
        self.pending.append(np.asarray(ids, dtype=self.dtype))
        self.pending_len += len(ids)
        while self.pending_len >= self.shard_tokens:
            stream = np.concatenate(self.pending)
            self._write_shard(stream[: self.shard_tokens].reshape(self.shape))
            rest = stream[self.shard_tokens :]
            self.pending, self.pending_len = [rest], len(rest)
        return len(ids)

    def _write_shard(self, samples: np.ndarray) -> None:
        index = len(self.shards)
        rel = shard_name(self.split, self.rank, index)
        data = encode_tar(samples, shard_key(self.split, self.rank, index))
        write_atomic(self.out_dir / rel, data)
        self.shards.append(
            {
                "path": rel,
                "samples": self.shape[0],
                "tokens": self.shard_tokens,
                "sha256": hashlib.sha256(data).hexdigest(),
            }
        )

    @property
    def tokens_written(self) -> int:
        return self.shard_tokens * len(self.shards)

    def summary(self) -> dict:
        return {
            "documents": self.documents,
            "tokens_encoded": self.tokens_encoded,
            "tokens_written": self.tokens_written,
            "tokens_dropped": self.tokens_encoded - self.tokens_written,
            "shards": self.shards,
        }


class TokenizeToShards(NoPackageScan, PipelineStepWithTokenizer):
    """Reader documents in, webdataset shards + a per-rank record (``.prep/ranks/RRRRR.json``) out."""

    name = "🧱 Tokenize + pack to webdataset shards"
    type = "✍️ - WRITER"

    def __init__(
        self,
        dataset_dir: str,
        tokenizer_name_or_path: str,
        eos_id: int,
        seq_len: int,
        sequences_per_sample: int,
        samples_per_shard: dict[str, int],
        val_fraction: float,
        dtype: str,
        batch_size: int = 256,
        encode_ahead: int = 2,
        encode_threads: int | None = None,
    ):
        # No eos_token for datatrove: its tokenizer would append EOS in a post-processor, which made encoding
        # ~4 % slower than the plain tokenizer here (benchmarks/bench_tokenize.py); the packer appends it.
        super().__init__(tokenizer_name_or_path)
        self.eos_id = eos_id  # data.eos_token's id, looked up once by prepare (dataset.eos_id)
        self.dataset_dir = str(dataset_dir)
        self.seq_len = seq_len
        self.sequences_per_sample = sequences_per_sample
        self.samples_per_shard = dict(samples_per_shard)
        self.val_fraction = val_fraction
        self.dtype = dtype
        self.batch_size = batch_size  # documents per encode_batch call
        self.encode_ahead = encode_ahead  # batches being encoded while one is packed
        self.encode_threads = encode_threads  # tokenizer threads in this task; None: every core

    def _clear_rank(self, out_dir: Path, rank: int) -> None:
        """A rerun redoes the task from scratch: drop whatever a killed attempt left for this rank."""
        for split in SPLITS:
            (out_dir / split).mkdir(parents=True, exist_ok=True)
            for p in (out_dir / split).glob(f"*shard-{rank:05d}-*"):
                p.unlink()
        rank_record(out_dir, rank).unlink(missing_ok=True)

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        if self.encode_threads is not None:
            # Local tasks share the machine's cores; rayon sizes its pool when this process first encodes.
            os.environ.setdefault("RAYON_NUM_THREADS", str(self.encode_threads))
        out_dir = Path(self.dataset_dir)
        self._clear_rank(out_dir, rank)
        tokenizer = self.tokenizer
        # Text that happens to contain "<|endoftext|>" is encoded as plain text: EOS only ends documents.
        tokenizer.encode_special_tokens = True
        encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)  # no offsets needed
        packers = {
            split: _SplitPacker(
                split,
                rank,
                out_dir,
                self.seq_len,
                self.sequences_per_sample,
                self.samples_per_shard[split],
                self.dtype,
                self.eos_id,
            )
            for split in SPLITS
        }

        def pack(batch, encoding):
            with self.track_time(unit="batch"):
                for doc, enc in zip(batch, encoding.result()):
                    split = "val" if is_val(str(doc.id), self.val_fraction) else "train"
                    tokens = packers[split].add(enc.ids)  # each read of .ids builds a new list: read once
                    self.stat_update(f"{split}_documents")
                    self.stat_update("tokens_encoded", value=tokens)

        # encode_batch releases the GIL and spreads a batch over every core. Batches are encoded on worker threads,
        # `encode_ahead` at a time, while this thread reads the next batch and packs the oldest, so reading,
        # packing and tar writes hide behind the tokenizer, and the next batch keeps the cores busy while the
        # last documents of one finish. Small batches keep the unhidden work at the start (reading the first
        # batch) and at the end (packing the last) small. Packing order is the input order.
        in_flight: deque = deque()
        with ThreadPoolExecutor(max_workers=self.encode_ahead) as encoder:
            for batch in batched(data, self.batch_size):
                in_flight.append((batch, encoder.submit(encode, [d.text for d in batch])))
                if len(in_flight) > self.encode_ahead:
                    pack(*in_flight.popleft())
            while in_flight:
                pack(*in_flight.popleft())

        record = {"rank": rank, "world_size": world_size}
        record.update({split: p.summary() for split, p in packers.items()})
        for split, p in packers.items():
            self.stat_update(f"{split}_shards", value=len(p.shards), unit="task")
            self.stat_update("tokens_written", value=p.tokens_written, unit="task")
            self.stat_update("tokens_dropped", value=p.tokens_encoded - p.tokens_written, unit="task")
        write_atomic(rank_record(out_dir, rank), json.dumps(record, indent=1).encode())
        return
        yield  # a generator, like every datatrove step; it passes nothing on

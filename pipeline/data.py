"""The data-parallel shard loader over a prepared dataset (the format pipeline/dataset.py defines).

Order is a pure function of (seed, epoch, DP rank, DP size), so a run resumes exactly from a saved position:
- each epoch the split's shard list is shuffled with a seeded RNG (the same on every rank), DP rank r takes
  shards r, r+DP, r+2DP, ... and the remainder is dropped so every rank sees equally many samples (uneven
  counts would hang collectives);
- samples inside a shard are visited in a per-(epoch, shard) seeded order, rows of a sample in order;
- TP peers pass the same *data-parallel* rank and therefore get identical batches. We never read the global
  RANK that webdataset's split_by_node uses.

A background thread reads, verifies (``dataset.read_shard``: sha256 and members, once per shard open; one extra
pass over bytes already in memory) and slices shards ahead of the consumer; the position handed out with each batch is the
position *after* it, so ``state_dict()`` describes what the training loop has consumed, not what was
prefetched.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.config import Config
from pipeline.dataset import MANIFEST, DataError, iter_rows, read_manifest, read_shard, sample_bytes, sha256_file


def check_compatible(manifest: dict[str, Any], cfg: Config) -> None:
    """Refuse a dataset whose tokenizer, vocab or sequence length disagree with the model config."""
    where = Path(cfg.data.dataset_dir) / MANIFEST
    tok = manifest["tokenizer"]
    if manifest["seq_len"] != cfg.model.seq_len:
        raise DataError(
            f"{where}: dataset seq_len={manifest['seq_len']} but model.seq_len={cfg.model.seq_len}; "
            f"set model.seq_len={manifest['seq_len']} or re-prepare the data"
        )
    if tok["vocab_size"] > cfg.model.vocab_size:  # smaller is fine: the embedding has unused rows
        raise DataError(
            f"{where}: dataset tokenizer vocab_size={tok['vocab_size']} exceeds model.vocab_size="
            f"{cfg.model.vocab_size}; set model.vocab_size={tok['vocab_size']} or re-prepare with the right tokenizer"
        )
    local = Path(cfg.data.tokenizer)
    if local.is_file():
        sha = sha256_file(local)
        if sha != tok["sha256"]:
            raise DataError(
                f"{where}: dataset was tokenized with a different tokenizer (sha256 {tok['sha256'][:12]}) than "
                f"data.tokenizer={cfg.data.tokenizer} (sha256 {sha[:12]}); point data.tokenizer at the "
                f"dataset's tokenizer or re-prepare"
            )
    else:  # a Hub name: data prep recorded the name it was given
        used = manifest["config"].get("data.tokenizer", tok["name_or_path"])
        if used != cfg.data.tokenizer:
            raise DataError(
                f"{where}: dataset tokenizer {used!r} differs from data.tokenizer={cfg.data.tokenizer!r}; "
                f"use the same tokenizer or re-prepare"
            )


# --- the loader ---------------------------------------------------------------------------------------
@dataclass
class Position:
    epoch: int = 0
    shard_cursor: int = 0  # index into this rank's shard list of the epoch
    row_cursor: int = 0  # index into the shard's shuffled row (sequence) order


class ShardLoader:
    """Yields int64 ``[batch_size, seq_len+1]`` numpy batches of the train split for one DP rank, forever."""

    def __init__(
        self,
        cfg: Config,
        *,
        dp_rank: int,
        dp_size: int,
        batch_size: int,
        split: str = "train",
        prefetch: int | None = None,
        manifest: dict[str, Any] | None = None,
        pin_memory: bool = False,
    ):
        self.pin_memory = pin_memory  # CUDA: batches in page-locked memory, so host->device copies are async
        self.dataset_dir = Path(cfg.data.dataset_dir)
        self.manifest = manifest if manifest is not None else read_manifest(self.dataset_dir)
        check_compatible(self.manifest, cfg)
        if split not in self.manifest["splits"]:
            raise DataError(f"{self.dataset_dir / MANIFEST}: no {split!r} split; re-run `prism prepare`")
        info = self.manifest["splits"][split]
        self.split = split
        self.shards: list[dict[str, Any]] = info["shards"]
        self.samples_per_shard = int(info["samples_per_shard"])
        self.seed, self.dp_rank, self.dp_size, self.batch_size = cfg.run.seed, dp_rank, dp_size, batch_size
        self.shards_per_rank = len(self.shards) // dp_size
        if self.shards_per_rank == 0:
            raise DataError(
                f"{self.dataset_dir / MANIFEST}: the {split} split has {len(self.shards)} shards, fewer than the "
                f"{dp_size} data-parallel ranks; re-prepare with a smaller data.samples_per_shard"
            )
        self._check_sizes()
        self.prefetch = max(1, cfg.train.prefetch if prefetch is None else prefetch)
        self.position = Position()  # after the last batch handed to the caller
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def _check_sizes(self) -> None:
        """Cheap check at start-up: every shard exists and is at least as large as its samples need."""
        need = self.samples_per_shard * (sample_bytes(self.manifest) + 512)  # + one tar header per member
        for entry in self.shards:
            path = self.dataset_dir / entry["path"]
            if not path.is_file():
                raise DataError(f"{path}: shard listed in the manifest is missing; re-run `prism prepare`")
            size = path.stat().st_size
            if size < need or entry["samples"] != self.samples_per_shard:
                raise DataError(
                    f"{path}: {size} bytes / {entry['samples']} samples, expected >= {need} bytes for "
                    f"{self.samples_per_shard} samples; the shard is truncated, re-run `prism prepare`"
                )

    # order: pure functions of (seed, epoch, rank)
    def epoch_shards(self, epoch: int) -> list[int]:
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.shards))
        mine = order[self.dp_rank :: self.dp_size][: self.shards_per_rank]
        return [int(i) for i in mine]

    def row_order(self, epoch: int, shard: int) -> np.ndarray:
        """Rows (sequences) of a shard in a seeded order: a batch mixes the whole shard, not one sample's
        consecutive sequences of the same few documents."""
        rows = self.samples_per_shard * int(self.manifest["sequences_per_sample"])
        return np.random.default_rng([self.seed, epoch, shard]).permutation(rows)

    # position
    def state_dict(self) -> dict[str, Any]:
        return {**asdict(self.position), "dp_rank": self.dp_rank, "dp_size": self.dp_size, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state["dp_size"], state["seed"]) != (self.dp_size, self.seed):
            raise DataError(
                f"loader position was saved with DP={state['dp_size']}, seed={state['seed']}; this run has "
                f"DP={self.dp_size}, seed={self.seed}; resume with the same number of data-parallel ranks"
            )
        self.close()
        self.position = Position(**{k: int(state[k]) for k in asdict(Position())})

    # reading
    def _produce(self, start: Position) -> None:
        p = Position(**asdict(start))
        pending: list[np.ndarray] = []  # a batch may span two shards
        have = 0
        try:
            while not self._stop.is_set():
                shard_id = self.epoch_shards(p.epoch)[p.shard_cursor]
                shard = read_shard(self.dataset_dir, self.manifest, self.split, self.shards[shard_id])
                table = shard.reshape(-1, shard.shape[-1])  # [rows, seq_len+1]
                order = self.row_order(p.epoch, shard_id)
                while p.row_cursor < len(order):
                    take = min(self.batch_size - have, len(order) - p.row_cursor)
                    pending.append(table[order[p.row_cursor : p.row_cursor + take]])
                    have += take
                    p.row_cursor += take
                    if have == self.batch_size:
                        batch = np.concatenate(pending).astype(np.int64)
                        if self.pin_memory:
                            batch = pinned(batch)
                        pending, have = [], 0
                        after = Position(**asdict(p))
                        if after.row_cursor == len(order):  # at a shard's end, point at the next one
                            after = self._next_shard(after)
                        if not self._put((batch, after)):
                            return
                p = self._next_shard(p)
        except BaseException as e:  # hand errors to the consumer instead of dying silently
            self._put((e, None))

    def _next_shard(self, p: Position) -> Position:
        p = Position(p.epoch, p.shard_cursor + 1, 0)
        if p.shard_cursor == self.shards_per_rank:
            p = Position(p.epoch + 1, 0, 0)
        return p

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _start(self) -> None:
        self._stop.clear()
        self._queue = queue.Queue(maxsize=self.prefetch)
        self._thread = threading.Thread(target=self._produce, args=(self.position,), daemon=True, name="prism-loader")
        self._thread.start()

    def next_batch(self) -> np.ndarray:
        if self._thread is None:
            self._start()
        batch, after = self._queue.get()
        if isinstance(batch, BaseException):
            self.close()
            raise batch
        self.position = after
        return batch

    def __iter__(self):
        while True:
            yield self.next_batch()

    def close(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self._queue = None


def pinned(batch: np.ndarray) -> np.ndarray:
    """The batch copied into page-locked memory; the array is a view that keeps the pinned tensor alive."""
    import torch

    return torch.from_numpy(batch).pin_memory().numpy()


def load_val_tokens(cfg: Config, manifest: dict[str, Any] | None = None) -> np.ndarray:
    """The fixed validation set: the first ``train.val_tokens // seq_len`` rows of the val split, in manifest
    and tar order (no shuffle), so both arms and every DP size see the same tokens. ``[n, seq_len+1]``."""
    dataset_dir = Path(cfg.data.dataset_dir)
    manifest = manifest if manifest is not None else read_manifest(dataset_dir)
    check_compatible(manifest, cfg)
    want = max(1, cfg.train.val_tokens // cfg.model.seq_len)
    rows = []
    for row in iter_rows(dataset_dir, "val", manifest):
        rows.append(row)
        if len(rows) == want:
            break
    if not rows:
        raise DataError(f"{dataset_dir / MANIFEST}: the val split is empty; prepare with data.val_fraction > 0")
    return np.stack(rows)  # fewer rows than asked for: the whole split

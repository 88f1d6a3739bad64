"""The data-parallel shard loader over a prepared dataset (the format pipeline/dataset.py defines).

Order is a pure function of (seed, epoch, DP rank, DP size), so a run resumes exactly from a saved position:
- each epoch the split's shard list is shuffled with a seeded RNG (the same on every rank), DP rank r takes
  shards r, r+DP, r+2DP, ... and the remainder is dropped so every rank sees equally many samples (uneven
  counts would hang collectives);
- samples inside a shard are visited in a per-(epoch, shard) seeded order, rows of a sample in order;
- TP peers pass the same *data-parallel* rank and therefore get identical batches. We never read the global
  RANK that webdataset's split_by_node uses.

A background thread reads, verifies (``dataset.read_shard``: sha256 and members, once per shard open; one extra
pass over bytes already in memory) and slices shards ahead of the consumer; the position handed out with each
batch is the position *after* it, so ``state_dict()`` describes what the training loop has consumed, not what
was prefetched.

Why it is over 400 lines: about 250 of them are ShardLoader, one object around one Position: the seeded order,
the prefetching thread that hands out the position after each batch, and the re-dealing of an epoch's unread
rows when a resume changes the DP size all move that position, so split up they would pass its internals
between files. The manifest checks before it (about 75) are what a start runs before the loader exists.
"""

from __future__ import annotations

import functools
import queue
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.config import Config
from pipeline.dataset import (
    MANIFEST,
    DataError,
    eos_id,
    iter_rows,
    read_manifest,
    read_shard,
    sample_bytes,
    sha256_file,
)


def checked_manifest(cfg: Config) -> dict[str, Any]:
    """The dataset's manifest, schema-checked and compatible with ``cfg`` (check_compatible hashes the
    tokenizer): read once per start and handed to the loader and the val set."""
    manifest = read_manifest(cfg.data.dataset_dir)
    check_compatible(manifest, cfg)
    return manifest


def checked_val_manifests(cfg: Config, own: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The manifest of every validation set (Config.validation_sets, keyed by metric), each checked like the
    training data: present, of the run's tokenizer and model.seq_len, holding its split. ``own`` is the run's
    checked manifest (the default set's). A problem is one line naming the set's key."""
    out = {}
    for vs in cfg.validation_sets():
        if vs.name is None:
            out[vs.metric] = own
            continue
        try:
            manifest = read_manifest(vs.dataset_dir)
            # the run's tokenizer file was hashed once for ``own``: its manifest holds that hash now
            check_compatible(
                manifest, cfg, vs.dataset_dir, f"re-prepare {vs.key} with the run's", own["tokenizer"]["sha256"]
            )
        except DataError as e:
            raise DataError(f"{vs.key}.dataset_dir: {e}") from None
        if not manifest["splits"][vs.split]["shards"]:
            raise DataError(f"{vs.key}.split: the {vs.split} split of {vs.dataset_dir} is empty; choose the other")
        out[vs.metric] = manifest
    return out


def check_compatible(
    manifest: dict[str, Any],
    cfg: Config,
    dataset_dir: str | Path | None = None,
    fix: str | None = None,
    tokenizer_sha: str | None = None,
) -> None:
    """Refuse a dataset whose tokenizer, vocab or sequence length disagree with the model config.
    ``dataset_dir`` (default data.dataset_dir): where it is; ``fix``: the advice instead of setting the key
    (a validation set must match the run, not the run it); ``tokenizer_sha``: data.tokenizer's sha256 when
    already known (one hash per start)."""
    where = Path(dataset_dir or cfg.data.dataset_dir) / MANIFEST
    tok = manifest["tokenizer"]
    if manifest["seq_len"] != cfg.model.seq_len:
        raise DataError(
            f"{where}: dataset seq_len={manifest['seq_len']} but model.seq_len={cfg.model.seq_len}; "
            + (f"{fix} model.seq_len" if fix else f"set model.seq_len={manifest['seq_len']} or re-prepare the data")
        )
    if tok["vocab_size"] > cfg.model.vocab_size:  # smaller is fine: the embedding has unused rows
        raise DataError(
            f"{where}: dataset tokenizer vocab_size={tok['vocab_size']} exceeds model.vocab_size="
            f"{cfg.model.vocab_size}; "
            + (
                f"{fix} data.tokenizer"
                if fix
                else f"set model.vocab_size={tok['vocab_size']} or re-prepare with the right tokenizer"
            )
        )
    local = Path(cfg.data.tokenizer)
    if local.is_file():
        sha = tokenizer_sha or sha256_file(local)
        if sha != tok["sha256"]:
            raise DataError(
                f"{where}: dataset was tokenized with a different tokenizer (sha256 {tok['sha256'][:12]}) than "
                f"data.tokenizer={cfg.data.tokenizer} (sha256 {sha[:12]}); "
                + (f"{fix} data.tokenizer" if fix else "point data.tokenizer at the dataset's tokenizer or re-prepare")
            )
        check_eos(manifest, cfg, eos_of(str(local), sha, cfg.data.eos_token), where, fix)
    else:  # a Hub name: data prep recorded the name it was given
        used = manifest["config"].get("data.tokenizer", tok["name_or_path"])
        if used != cfg.data.tokenizer:
            raise DataError(
                f"{where}: dataset tokenizer {used!r} differs from data.tokenizer={cfg.data.tokenizer!r}; "
                + (f"{fix} data.tokenizer" if fix else "use the same tokenizer or re-prepare")
            )


@functools.lru_cache(maxsize=4)
def eos_of(tokenizer_path: str, sha: str, eos_token: str) -> int:
    """data.eos_token's id in the tokenizer file, read once per start however many datasets are checked
    (its sha256 is in the key: a file rewritten since is read again)."""
    from tokenizers import Tokenizer

    return eos_id(Tokenizer.from_file(tokenizer_path), eos_token, tokenizer_path)


def check_eos(manifest: dict[str, Any], cfg: Config, run_eos: int, where: Path, fix: str | None = None) -> None:
    """Refuse a run whose data.eos_token (id ``run_eos``) is not the token the dataset's documents end with
    (the manifest's tokenizer.eos_id): its evals and exports would end documents with another token than it
    trained on. ``fix``: the advice for a validation set, which must match the run."""
    used = manifest["tokenizer"]["eos_id"]
    if run_eos != used:
        spelled = manifest["config"].get("data.eos_token", f"the token of id {used}")
        raise DataError(
            f"{where}: the dataset ends documents with {spelled!r} (token {used}), not data.eos_token="
            f"{cfg.data.eos_token!r}; "
            + (f"{fix} data.eos_token" if fix else f"set data.eos_token={spelled!r} or re-prepare")
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
        self.manifest = manifest if manifest is not None else checked_manifest(cfg)  # given: checked by the caller
        if split not in self.manifest["splits"]:
            raise DataError(f"{self.dataset_dir / MANIFEST}: no {split!r} split; re-run `prism prepare`")
        info = self.manifest["splits"][split]
        self.split = split
        self.shards: list[dict[str, Any]] = info["shards"]
        self.samples_per_shard = int(info["samples_per_shard"])
        self.seed, self.dp_rank, self.dp_size, self.batch_size = cfg.run.seed, dp_rank, dp_size, batch_size
        self.shards_per_rank = len(self.shards) // dp_size
        if not self.shards:
            raise DataError(
                f"{self.dataset_dir / MANIFEST}: the {split} split is empty (data.val_fraction=1 puts every "
                f"document in val: a validation set's dataset); train on a dataset prepared with a lower one"
            )
        if self.shards_per_rank == 0:
            raise DataError(
                f"{self.dataset_dir / MANIFEST}: the {split} split has {len(self.shards)} shards, fewer than the "
                f"{dp_size} data-parallel ranks; re-prepare with a smaller data.samples_per_shard"
            )
        self._check_sizes()
        self.prefetch = max(1, cfg.train.prefetch if prefetch is None else prefetch)
        self.position = Position()  # after the last batch handed to the caller
        # Rows (sequences) per optimizer step over all DP ranks: fixed by the plan, whatever the DP size.
        self.rows_per_step = cfg.train.batch_tokens // cfg.model.seq_len
        self.transition: dict[str, Any] | None = None  # after a DP change: see load_state_dict
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
        return self._shards_of(epoch, self.dp_rank, self.dp_size)

    def _shards_of(self, epoch: int, dp_rank: int, dp_size: int) -> list[int]:
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.shards))
        mine = order[dp_rank::dp_size][: len(self.shards) // dp_size]
        return [int(i) for i in mine]

    def row_order(self, epoch: int, shard: int) -> np.ndarray:
        """Rows (sequences) of a shard in a seeded order: a batch mixes the whole shard, not one sample's
        consecutive sequences of the same few documents."""
        rows = self.samples_per_shard * int(self.manifest["sequences_per_sample"])
        return np.random.default_rng([self.seed, epoch, shard]).permutation(rows)

    # position
    def state_dict(self) -> dict[str, Any]:
        transition = None if self.transition is None else dict(self.transition)
        return {
            **asdict(self.position),
            "dp_rank": self.dp_rank,
            "dp_size": self.dp_size,
            "seed": self.seed,
            "transition": transition,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position saved by this rank, or by any rank of a run at another DP size.

        After a DP change the rest of the saved epoch is a *transition*: the rows every old rank had still
        to read, arranged step by step as the old run would have consumed them (old rank 0's rows of the
        step, then rank 1's, ...), and each step's rows dealt to the new ranks in contiguous blocks. So every
        optimizer step sees the same global batch the old run would have, no row is skipped or repeated
        (except, at the epoch's very end, fewer than new-DP rows when the last step's rows do not divide),
        and the next epoch starts in the new layout. All ranks of a run stand at the same position, so any
        saved rank's state serves; a change during a transition nests (its unread rest becomes the source)."""
        if state["seed"] != self.seed:
            raise DataError(
                f"loader position was saved with seed={state['seed']}; this run has seed={self.seed}; "
                f"resume with the same run.seed"
            )
        self.close()
        position = Position(**{k: int(state[k]) for k in asdict(Position())})
        transition = state.get("transition")
        if state["dp_size"] == self.dp_size:
            self.position, self.transition = position, transition
            return
        for size in (state["dp_size"], self.dp_size):
            if self.rows_per_step % size:
                raise DataError(
                    f"{self.rows_per_step} rows per step do not divide over {size} data-parallel ranks; resume "
                    f"with a DP size that divides train.batch_tokens / model.seq_len"
                )
        source: dict[str, Any] = {"dp_size": int(state["dp_size"]), "epoch": position.epoch}
        if transition is not None:
            source["parent"] = transition
        else:
            source.update(shard_cursor=position.shard_cursor, row_cursor=position.row_cursor)
        self.position = Position(position.epoch, 0, 0)
        self.transition = {"source": source, "consumed": 0}

    def _rest_per_rank(self, source: dict[str, Any]) -> list[np.ndarray]:
        """Global row ids (shard * rows_per_shard + row) each rank of ``source['dp_size']`` had still to read
        in ``source['epoch']``; equally many per rank."""
        size, epoch = source["dp_size"], source["epoch"]
        rows_per_shard = self.samples_per_shard * int(self.manifest["sequences_per_sample"])
        if "parent" in source:  # the unread part of an earlier transition, dealt over ``size`` ranks
            parent = source["parent"]
            whole = _interleave(self._rest_per_rank(parent["source"]), self.rows_per_step)
            return [share[parent["consumed"] :] for share in _deal(whole, size, self.rows_per_step)]
        rest = []
        for rank in range(size):
            shards = self._shards_of(epoch, rank, size)[source["shard_cursor"] :]
            ids = [shard * rows_per_shard + self.row_order(epoch, shard) for shard in shards]
            flat = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
            rest.append(flat[source["row_cursor"] :])
        return rest

    def transition_rows(self) -> np.ndarray:
        """This rank's rows of the transition (all of them, from its start): global row ids."""
        whole = _interleave(self._rest_per_rank(self.transition["source"]), self.rows_per_step)
        return _deal(whole, self.dp_size, self.rows_per_step)[self.dp_rank]

    # reading
    def _produce(self, start: Position, transition: dict[str, Any] | None = None) -> None:
        p = Position(**asdict(start))
        pending: list[np.ndarray] = []  # a batch may span two shards
        have = 0
        try:
            if transition is not None:  # after a DP change: the rest of the epoch, then the new layout
                pending, have, p = self._produce_transition(p, transition)
                if pending is None:
                    return
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
                        if not self._put((batch, (after, None))):
                            return
                p = self._next_shard(p)
        except BaseException as e:  # hand errors to the consumer instead of dying silently
            self._put((e, None))

    def _produce_transition(self, p: Position, transition: dict[str, Any]) -> tuple[Any, int, Position]:
        """Batches from this rank's transition rows; returns the unfinished batch's parts, their row count
        and the position to continue from (the next epoch's start), or (None, 0, p) when stopped."""
        rows = self.transition_rows()
        rows_per_shard = self.samples_per_shard * int(self.manifest["sequences_per_sample"])
        tables: dict[int, np.ndarray] = {}  # shards read so far, a few kept (the rows alternate between them)
        pending: list[np.ndarray] = []
        have, i = 0, transition["consumed"]
        nxt = Position(p.epoch + 1, 0, 0)
        while i < len(rows):
            take = rows[i : i + self.batch_size - have]
            for shard_id in dict.fromkeys((take // rows_per_shard).tolist()):
                if shard_id not in tables:
                    if len(tables) >= 8:
                        tables.pop(next(iter(tables)))
                    shard = read_shard(self.dataset_dir, self.manifest, self.split, self.shards[shard_id])
                    tables[shard_id] = shard.reshape(-1, shard.shape[-1])
            pending.append(np.stack([tables[r // rows_per_shard][r % rows_per_shard] for r in take.tolist()]))
            have += len(take)
            i += len(take)
            if have == self.batch_size:
                batch = np.concatenate(pending).astype(np.int64)
                pending, have = [], 0
                done = i == len(rows)
                after = (nxt, None) if done else (p, {**transition, "consumed": i})
                if not self._put((batch, after)):
                    return None, 0, p
        return pending, have, nxt

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
        self._thread = threading.Thread(
            target=self._produce, args=(self.position, self.transition), daemon=True, name="prism-loader"
        )
        self._thread.start()

    def next_batch(self) -> np.ndarray:
        if self._thread is None:
            self._start()
        batch, after = self._queue.get()
        if isinstance(batch, BaseException):
            self.close()
            raise batch
        self.position, self.transition = after
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


def _interleave(per_rank: list[np.ndarray], rows_per_step: int) -> np.ndarray:
    """One sequence from equally long per-rank row streams, step by step as a DP run consumes them: each
    step's rows of rank 0, then of rank 1, ... (the last step may be short)."""
    size, length = len(per_rank), len(per_rank[0]) if per_rank else 0
    per = rows_per_step // size
    full = length // per
    stacked = np.stack(per_rank) if per_rank else np.zeros((0, 0), dtype=np.int64)
    head = stacked[:, : full * per].reshape(size, full, per).transpose(1, 0, 2).reshape(-1)
    return np.concatenate([head, stacked[:, full * per :].reshape(-1)])


def _deal(rows: np.ndarray, size: int, rows_per_step: int) -> list[np.ndarray]:
    """Split a step-ordered row sequence over ``size`` ranks: each step's rows in contiguous blocks; a short
    last step is split evenly and its remainder (< size rows) dropped so every rank reads equally many."""
    per = rows_per_step // size
    full = len(rows) // rows_per_step
    head = rows[: full * rows_per_step].reshape(full, size, per)
    tail = rows[full * rows_per_step :]
    each = len(tail) // size
    return [np.concatenate([head[:, r, :].reshape(-1), tail[r * each : (r + 1) * each]]) for r in range(size)]


def pinned(batch: np.ndarray) -> np.ndarray:
    """The batch copied into page-locked memory; the array is a view that keeps the pinned tensor alive."""
    import torch

    return torch.from_numpy(batch).pin_memory().numpy()


def load_val_tokens(cfg: Config, manifest: dict[str, Any] | None = None, vs: Any = None) -> np.ndarray:
    """A fixed validation set (``vs``, one of Config.validation_sets; default the run's own val split): its
    first ``tokens // seq_len`` rows, in manifest and tar order (no shuffle), so both arms and every DP size
    see the same tokens. ``[n, seq_len+1]``. ``manifest``: the set's, checked by the caller."""
    vs = vs or cfg.validation_sets()[0]
    dataset_dir = Path(vs.dataset_dir)
    manifest = manifest if manifest is not None else checked_manifest(cfg)  # given: checked by the caller
    want = max(1, vs.tokens // cfg.model.seq_len)
    rows = []
    for row in iter_rows(dataset_dir, vs.split, manifest):
        rows.append(row)
        if len(rows) == want:
            break
    if not rows:
        raise DataError(f"{dataset_dir / MANIFEST}: the {vs.split} split is empty; prepare with data.val_fraction > 0")
    return np.stack(rows)  # fewer rows than asked for: the whole split

"""Elastic resume of the shard loader on the real prepared tiny dataset: a position saved at one data-parallel
size continues at another (2 -> 1, 2 -> 4, and a second change in the middle of the first one's transition)
with every row of the epoch read exactly once, each step's global batch the one the old run would have read,
and the next epoch in the new layout. Ranks are simulated in-process: each DP rank is its own ShardLoader."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from pipeline import config, data
from pipeline.dataset import DataError

ROOT = Path(__file__).resolve().parents[2]
MICRO = 4
ROWS_PER_STEP = 32  # train.batch_tokens=4096 at seq_len 128


def load_cfg(tiny_data, *extra: str) -> config.Config:
    return config.load(
        ROOT / "configs" / "tiny_prism.yaml",
        [*tiny_data.overrides, "train.batch_tokens=4096", f"train.micro_batch_size={MICRO}", *extra],
    )


def loaders(cfg, dp: int) -> list[data.ShardLoader]:
    return [data.ShardLoader(cfg, dp_rank=r, dp_size=dp, batch_size=MICRO) for r in range(dp)]


def step(group: list[data.ShardLoader]) -> list[bytes]:
    """One optimizer step's global batch: every rank's micro-batches (grad accumulation adapts to DP)."""
    accum = ROWS_PER_STEP // (MICRO * len(group))
    return [row.tobytes() for _ in range(accum) for loader in group for row in loader.next_batch()]


def close(group) -> None:
    for loader in group:
        loader.close()


def resume(cfg, saved: dict, dp: int) -> list[data.ShardLoader]:
    group = loaders(cfg, dp)
    for loader in group:
        loader.load_state_dict(json.loads(json.dumps(saved)))  # as stored in a checkpoint
    return group


def epoch_rows(cfg, dp: int, epoch: int) -> Counter:
    """Every row the DP layout reads in ``epoch`` (its shards; the remainder shards are dropped)."""
    probe = loaders(cfg, dp)
    rows_per_shard = probe[0].samples_per_shard * 16
    manifest = probe[0].manifest
    from pipeline.dataset import read_shard

    out: Counter = Counter()
    for loader in probe:
        for shard_id in loader.epoch_shards(epoch):
            table = read_shard(loader.dataset_dir, manifest, "train", loader.shards[shard_id]).reshape(-1, 129)
            assert len(table) == rows_per_shard
            out.update(r.astype(np.int64).tobytes() for r in table)
    close(probe)
    return out


@pytest.mark.parametrize("new_dp", [1, 4])
def test_dp2_position_continues_at_new_dp_with_the_same_global_batches(tiny_data, new_dp):
    cfg = load_cfg(tiny_data)
    steps_per_epoch = sum(epoch_rows(cfg, 2, 0).values()) // ROWS_PER_STEP  # 4608 rows -> 144 steps
    cut = 37  # mid-shard: each old rank is 592 rows (2 shards + 80 rows) into the epoch
    old = loaders(cfg, 2)
    before = [step(old) for _ in range(cut)]
    saved = old[0].state_dict()
    # the uninterrupted DP=2 run: what each later step of the epoch would have read
    uninterrupted = [step(old) for _ in range(steps_per_epoch - cut)]
    close(old)

    new = resume(cfg, saved, new_dp)
    after = [step(new) for _ in range(steps_per_epoch - cut)]
    # same global batch, step by step, as the old run (so the loss continues as if nothing changed)
    assert [sorted(b) for b in after] == [sorted(b) for b in uninterrupted]
    # every row of the epoch exactly once across the change, none skipped, none repeated
    assert Counter(r for b in before + after for r in b) == epoch_rows(cfg, 2, 0)
    # then the next epoch in the new layout, exactly as a fresh DP=new_dp run reads it
    assert all(s["transition"] is None and s["epoch"] == 1 for s in (ld.state_dict() for ld in new))
    fresh = loaders(cfg, new_dp)
    for loader in fresh:
        loader.load_state_dict({**loader.state_dict(), "epoch": 1})
    assert [step(new) for _ in range(5)] == [step(fresh) for _ in range(5)]
    close(new)
    close(fresh)


def test_mid_transition_resume_and_a_second_dp_change_keep_every_row_once(tiny_data):
    cfg = load_cfg(tiny_data)
    old = loaders(cfg, 2)
    seen = [step(old) for _ in range(37)]
    saved = old[0].state_dict()
    close(old)
    at1 = resume(cfg, saved, 1)
    seen += [step(at1) for _ in range(10)]
    # a checkpoint in the middle of the transition resumes exactly at the same DP size
    mid = at1[0].state_dict()
    assert mid["transition"] is not None
    expect = [step(at1) for _ in range(10)]
    again = resume(cfg, mid, 1)
    assert [step(again) for _ in range(10)] == expect
    seen += expect
    close(at1)
    # and at another one: 1 -> 4 while still in the 2 -> 1 transition
    at4 = resume(cfg, again[0].state_dict(), 4)
    close(again)
    total = sum(epoch_rows(cfg, 2, 0).values()) // ROWS_PER_STEP
    seen += [step(at4) for _ in range(total - len(seen))]
    assert Counter(r for b in seen for r in b) == epoch_rows(cfg, 2, 0)
    assert all(ld.state_dict()["epoch"] == 1 and ld.state_dict()["transition"] is None for ld in at4)
    close(at4)


def test_a_dp_size_that_does_not_divide_the_step_is_refused(tiny_data):
    cfg = load_cfg(tiny_data, "train.batch_tokens=1536", "train.micro_batch_size=4")  # 12 rows per step
    saved = data.ShardLoader(cfg, dp_rank=0, dp_size=2, batch_size=4).state_dict()
    with pytest.raises(DataError, match="12 rows per step do not divide over 8"):
        data.ShardLoader(cfg, dp_rank=0, dp_size=8, batch_size=4).load_state_dict(saved)
    with pytest.raises(DataError, match="same run.seed"):
        data.ShardLoader(cfg, dp_rank=0, dp_size=1, batch_size=4).load_state_dict({**saved, "seed": 99})

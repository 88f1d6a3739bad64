"""Starting a checkpoint tag and committing it. The commit order is one rule, ``commit_tag``: the integrity
record, then ``latest``, then pruning (rank 0). A synchronous save and a background one
(pipeline.checkpoint.writer) both end in it, so a tag reads the same however it was written. A write that
fails on any rank is agreed over all ranks and its partial folder removed (``agreed_failure``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from pipeline import cadence, checkpoint
from pipeline.atomic import write_atomic, write_failure_cause
from pipeline.checkpoint.restore import TrainState
from pipeline.config import Config


# --- a save: its start and its commit ---------------------------------------------------------------------
def begin_save(cfg: Config, state: TrainState) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """Every rank, before DeepSpeed writes tag ``step-NNNNNNN``: (tag, the client state with every rank's
    loader position and RNG states gathered, the integrity record's fields). A folder left under that tag
    (by a run rolled back past it, or a save that died) is removed first: two saves never mix."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    own = state.state_dict()
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, {k: own[k] for k in TrainState.PER_RANK})
    tag = checkpoint.tag_for(state.step)
    client_state = {
        "tokens_seen": own["tokens_seen"],
        "run_id": own["run_id"],
        "prism": {"step": own["step"], "ranks": ranks, "skips": own["skips"]},
    }
    meta = {
        "step": own["step"],
        "tp": cfg.parallel.tp,
        "dp_size": parallel_state.get_data_parallel_world_size(),
        "world_size": dist.get_world_size(),
    }
    if dist.get_rank() == 0 and (cfg.checkpoint_dir / tag).exists():
        shutil.rmtree(cfg.checkpoint_dir / tag)
    dist.barrier()
    return tag, client_state, meta


def commit_tag(cfg: Config, tag: str, meta: dict[str, Any], files: dict[str, dict[str, Any]]) -> None:
    """Global rank 0, every rank's files on disk; ``files``: the records the ranks made of the files they
    wrote or hashed. The one commit order: the integrity record (a file no rank recorded, such as DeepSpeed's
    zero_to_fp32.py, is hashed here), then ``latest``, then pruning. Until the record is written the tag is
    not a checkpoint; until ``latest`` moves a resume takes the previous one."""
    tag_dir = cfg.checkpoint_dir / tag
    files = dict(files)
    for path in checkpoint.tag_files(tag_dir):
        if path.name not in files:
            files[path.name] = checkpoint.file_record(path)
    checkpoint.write_record(tag_dir, meta, dict(sorted(files.items())))
    write_atomic(cfg.checkpoint_dir / checkpoint.LATEST, tag)
    prune(cfg.checkpoint_dir, cfg, keep=tag)  # marks a milestone, then prunes


def agreed_failure(failure: BaseException | None, ckpt_dir: Path, tag: str, group: Any = None) -> str | None:
    """A collective over ``group`` (default: all ranks): None if no rank failed to write ``tag``, else the first
    failing rank's cause in a few words, the same on every rank. The partial folder is removed so nothing
    half-written stays (and its space comes back); ``latest`` never names it."""
    import torch
    import torch.distributed as dist

    on = "cuda" if group is None and dist.get_backend() == "nccl" else "cpu"  # NCCL reduces CUDA tensors only
    flag = torch.tensor([0.0 if failure is None else 1.0], device=on)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if not flag.item():
        return None
    causes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(causes, None if failure is None else write_failure_cause(failure, ckpt_dir), group=group)
    if dist.get_rank() == 0:
        shutil.rmtree(Path(ckpt_dir) / tag, ignore_errors=True)
        if checkpoint.read_latest(ckpt_dir) == tag:  # the pointer itself may have been the write that failed
            (Path(ckpt_dir) / checkpoint.LATEST).unlink(missing_ok=True)
    dist.barrier(group=group)
    return next(c for c in causes if c is not None)


# --- which tags survive: keep_last, milestones ----------------------------------------------------------
# A milestone tag says so in its integrity record ("milestone": true, set by prune right after its commit). A
# weights-only one also has "weights_only": true and lists only the files it kept ("dropped": the others):
# the record stays true to the folder, and the resume passes it over.
OPTIMIZER_FILES = ("*optim_states.pt",)  # what a weights-only milestone drops (ZeRO partitions, AdamW)


def prune(checkpoint_dir: Path, cfg: Config, keep: str) -> None:
    """After ``keep`` is committed (rank 0): mark it a milestone when it is one; of the other tags, the newest
    checkpoint.keep_last stay as they are, older milestones stay (weights-only when
    checkpoint.milestone_weights_only), everything else is deleted."""
    ckpt_dir, c = Path(checkpoint_dir), cfg.checkpoint
    step = checkpoint.tag_step(keep)
    if step is not None and cadence.is_milestone(step, c.keep_every_steps, cfg.steps(1)["total"]):
        _update_record(ckpt_dir / keep, milestone=True)
    kept = checkpoint.tag_names(ckpt_dir)
    newest = set(kept[-max(1, c.keep_last) :]) | {keep}
    for tag in kept:
        if tag in newest:
            continue
        record = checkpoint.read_integrity(ckpt_dir / tag) or {}
        if not record.get("milestone"):
            shutil.rmtree(ckpt_dir / tag, ignore_errors=True)
        elif c.milestone_weights_only or record.get("weights_only"):
            weights_only(ckpt_dir / tag)


def weights_only(tag_dir: Path) -> None:
    """Drop a tag's optimizer files (idempotent): the record is rewritten first, without them, so a crash in
    between leaves extra files, never a record naming missing ones. Only a tag whose weights are files of
    their own (mp_rank_*_model_states.pt: ZeRO-1/2) is thinned; ZeRO-0 keeps the optimizer inside that file and
    ZeRO-3 the weights inside the optimizer's, so theirs stay full."""
    record = checkpoint.read_integrity(tag_dir) or {}
    files = record.get("files", {})
    dropped = sorted(
        {*record.get("dropped", ()), *(n for n in files if any(Path(n).match(g) for g in OPTIMIZER_FILES))}
    )
    if not any(Path(n).match("mp_rank_*_model_states.pt") for n in files) or not dropped:
        return
    if not record.get("weights_only"):
        kept = {n: v for n, v in files.items() if n not in dropped}
        _update_record(tag_dir, weights_only=True, files=kept, dropped=dropped)
    for name in dropped:
        (Path(tag_dir) / name).unlink(missing_ok=True)


def _update_record(tag_dir: Path, **changes: Any) -> None:
    record = checkpoint.read_integrity(tag_dir)
    if record is not None and any(record.get(k) != v for k, v in changes.items()):
        write_atomic(Path(tag_dir) / checkpoint.INTEGRITY, json.dumps({**record, **changes}, indent=1))

"""Checkpoints: the train state, DeepSpeed's files, an atomic ``latest`` pointer, keep-last-K pruning.

Layout: ``<checkpoint_dir>/step-0000123/`` holds DeepSpeed's ``mp_rank_XX_model_states.pt`` (its "module"
entry is the model state dict; our client state rides along inside it) and ZeRO ``*_optim_states.pt``,
plus ``config.yaml`` and ``integrity.json`` (every file's size and sha256, written last, atomically).
``<checkpoint_dir>/latest`` names the newest complete tag; it is replaced (temp + rename) only after every rank
has finished writing and the integrity record is on disk, so a checkpoint killed half-way is never picked up.
Before a resume the record is checked; a damaged newest checkpoint falls back to the newest intact one kept.
During training, pipeline.checkpoint_writer decides how a save is written (synchronously with ``save`` here,
or staged and written in the background) and when it commits; the record and ``latest`` keep this order.

Client state: ``{"tokens_seen", "run_id", "prism": {"step", "ranks", "config_hash"}}``. DeepSpeed writes it
only from DP rank 0, so the per-rank parts of the train state (loader position, RNG states) are gathered to
every rank first and stored as one list indexed by global rank.

This module alone knows that layout: the trainer saves and loads a TrainState, readers (inference) get
weights through resolve_tag_dir and read_weights. A load at another TP or DP size than the save goes through
pipeline.reshard (DeepSpeed's universal checkpoint).

Why it is over 400 lines: it is one contract, the layout above. The file names, the integrity record, saving
and loading, the choice of tag to resume, the policy of what a resume may change, pruning and reading weights
back all read or write that layout, so a change to it stays in this module. The parts that are not about the
layout live elsewhere: the TP re-split in pipeline.reshard, the key sets in config.resume_keys, how and when a
save is written in pipeline.checkpoint_writer.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from pipeline.atomic import folder_write_problem, write_atomic, write_failure_cause
from pipeline.config import Config, ConfigError, changed_keys

LATEST = "latest"
CONFIG_NAME = "config.yaml"
INTEGRITY = "integrity.json"  # {"files": {name: {"size", "sha256"}}, "step", "tp", "dp_size", "world_size"}


def model_states_file(tp_rank: int) -> str:
    """DeepSpeed's file of one TP rank's weights: TP=N writes mp_rank_00 .. mp_rank_N-1."""
    return f"mp_rank_{tp_rank:02d}_model_states.pt"


MODEL_STATES = model_states_file(0)


def tag_for(step: int) -> str:
    return f"step-{step:07d}"


def config_file(tag_dir: Path) -> Path:
    """The config the checkpoint was trained with."""
    return Path(tag_dir) / CONFIG_NAME


# --- where checkpoints are -------------------------------------------------------------------------------
def read_latest(checkpoint_dir: Path) -> str | None:
    """What ``<checkpoint_dir>/latest`` says, unchecked (None without the file): the pointer's one reader."""
    pointer = Path(checkpoint_dir) / LATEST
    return pointer.read_text().strip() if pointer.is_file() else None


def latest_tag(checkpoint_dir: Path) -> str | None:
    """The tag ``<checkpoint_dir>/latest`` names, None without one; refuses a pointer to a missing folder."""
    pointer = Path(checkpoint_dir) / LATEST
    tag = read_latest(checkpoint_dir)
    if tag is None:
        return None
    if not (Path(checkpoint_dir) / tag).is_dir():
        raise ConfigError(
            f"{pointer}: names tag {tag!r}, which does not exist; restore that folder, pass an existing tag "
            f"folder, or delete {pointer} to start the run over"
        )
    return tag


def resolve_tag_dir(path: str | Path, step: int | None = None) -> Path:
    """The tag folder ``path`` names: a tag folder, a checkpoint folder (its `latest`) or a run folder
    (``<run_dir>/checkpoints/latest``); with ``step``, that step's tag of the run (a milestone, say)."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path}: checkpoint not found; pass a tag folder (.../step-0000123) or a checkpoint folder")
    if step is not None:
        return _tag_at_step(path, step)
    for candidate in (path, path / "checkpoints"):
        if config_file(candidate).is_file():
            return candidate
        tag = latest_tag(candidate)
        if tag is not None:
            return candidate / tag
    raise ConfigError(f"{path}: neither a checkpoint tag folder (config.yaml) nor a folder with a `latest` file")


def checkpoint_folder(path: str | Path) -> Path:
    """The folder holding a run's tags: ``path`` itself, a run folder's checkpoints/, or a tag's parent."""
    path = Path(path)
    for candidate in (path / "checkpoints", path):
        if candidate.is_dir() and (read_latest(candidate) is not None or tag_names(candidate)):
            return candidate
    if config_file(path).is_file():
        return path.parent
    raise ConfigError(f"{path}: no checkpoints in it; pass a run folder, its checkpoints/ folder or a tag folder")


def _tag_at_step(path: Path, step: int) -> Path:
    folder = checkpoint_folder(path)
    tag_dir = folder / tag_for(step)
    if config_file(tag_dir).is_file():
        return tag_dir
    have = [_tag_step(t) for t in tag_names(folder)]
    marks = set(milestone_tags(folder))
    listed = ", ".join(f"{s}{' (milestone)' if tag_for(s) in marks else ''}" for s in have) or "none"
    raise ConfigError(f"{folder}: no checkpoint at step {step}; steps kept: {listed}")


# --- integrity: what a complete checkpoint holds ----------------------------------------------------------
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _world() -> tuple[int, int]:
    """(rank, world size) of the default process group, (0, 1) without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _hash_shared(paths: list[Path]) -> dict[str, str]:
    """sha256 of every path, the work dealt round-robin over the ranks (a collective when there are several)."""
    import torch.distributed as dist

    rank, world = _world()
    mine = {p.name: _sha256(p) for p in paths[rank::world]}
    if world == 1:
        return mine
    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, mine)
    return {k: v for part in parts for k, v in part.items()}


def write_integrity(tag_dir: Path, meta: dict[str, Any]) -> None:
    """Every rank: hash the tag folder's files (shared out); rank 0 writes the record atomically, last."""
    files = tag_files(tag_dir)
    hashes = _hash_shared(files)
    if _world()[0] == 0:
        write_record(tag_dir, meta, {p.name: {"size": p.stat().st_size, "sha256": hashes[p.name]} for p in files})


def file_record(path: Path) -> dict[str, Any]:
    """One file's entry in the integrity record."""
    return {"size": path.stat().st_size, "sha256": _sha256(path)}


def tag_files(tag_dir: Path) -> list[Path]:
    """The files the integrity record covers: every visible file of the tag folder but the record."""
    return sorted(
        p for p in Path(tag_dir).iterdir() if p.is_file() and not p.name.startswith(".") and p.name != INTEGRITY
    )


def write_record(tag_dir: Path, meta: dict[str, Any], files: dict[str, dict[str, Any]]) -> None:
    """The integrity record, atomically: the last file of a tag."""
    write_atomic(Path(tag_dir) / INTEGRITY, json.dumps({**meta, "files": files}, indent=1))


def read_integrity(tag_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((Path(tag_dir) / INTEGRITY).read_text())
    except (OSError, ValueError):
        return None


def verify(tag_dir: Path, hashes: bool = True) -> str | None:
    """None if the tag folder matches its integrity record, else what is wrong (one phrase). Every rank
    calls it together: the sha256 work is shared out."""
    tag_dir = Path(tag_dir)
    record = read_integrity(tag_dir)
    if record is None:
        return f"{INTEGRITY} is missing or unreadable (the save did not complete)"
    present = []
    for name, want in sorted(record["files"].items()):
        path = tag_dir / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != want["size"]:
            return f"{name} has {size} bytes, the record says {want['size']} (truncated or overwritten)"
        present.append(path)
    if hashes:
        got = _hash_shared(present)
        for path in present:
            if got[path.name] != record["files"][path.name]["sha256"]:
                return f"{path.name} does not match its sha256 (corrupted)"
    return None


# --- choosing where to resume ---------------------------------------------------------------------------
@dataclass
class Resume:
    """Where a run continues: ``tag`` None for a fresh start; ``finished`` when the saved step is the last."""

    tag: str | None = None
    step: int = 0
    finished: bool = False
    saved_dp_size: int | None = None
    saved_tp: int | None = None
    damaged: list[str] = field(default_factory=list)  # newer tags passed over, "<tag>: <what is wrong>" each
    # the checkpoint folder ``tag`` is in when it is not this run's: a cooldown branch's first start loads its main
    # run's tag from there (read only; pipeline.cooldown.start_point decides it)
    source_dir: Path | None = None


def _tag_step(name: str) -> int | None:
    if len(name) == len(tag_for(0)) and name.startswith("step-") and name[5:].isdigit():
        return int(name[5:])
    return None


def tag_names(checkpoint_dir: str | Path) -> list[str]:
    """The tag folders of a checkpoint folder, oldest first, intact or not: each reader applies its own
    policy to them (resume falls back past damaged ones, export and eval refuse, pruning keeps milestones)."""
    folder = Path(checkpoint_dir)
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if _tag_step(p.name) is not None and p.is_dir())


def check_writable(folder: Path) -> None:
    """The checkpoint folder can be created and written: otherwise one line naming the path and the cause."""
    if (cause := folder_write_problem(folder)) is not None:
        raise ConfigError(
            f"{folder}: cannot create or write the checkpoint folder ({cause}); point run.output_dir "
            f"(or checkpoint.dir) at a writable folder"
        )


def resume_point(cfg: Config) -> Resume:
    """Decide how ``cfg`` starts, before anything expensive: fresh, resume from the newest intact checkpoint
    (falling back past damaged ones, saying so), a no-op for a finished run, or a one-line refusal (nothing
    intact, a changed recipe, an unsupported change of layout). Every rank calls it (hash checks are shared)."""
    ckpt_dir = Path(cfg.checkpoint_dir)
    _, world = _world()
    dp = world // cfg.parallel.tp if world % cfg.parallel.tp == 0 else None
    check_writable(ckpt_dir)
    pointer = ckpt_dir / LATEST
    named, limit, pointer_problem = read_latest(ckpt_dir), None, None
    if named is not None:
        if _tag_step(named) is None:
            pointer_problem = f"{pointer} holds {named!r}, not a checkpoint tag"
            named = None
        elif not (ckpt_dir / named).is_dir():
            pointer_problem = f"{pointer} names {named}, which does not exist"
            named = None
        else:
            limit = _tag_step(named)
    candidates = tag_names(ckpt_dir)[::-1]  # newest first
    if limit is not None:  # a user may repoint `latest` at an older tag to roll back: respect it
        candidates = [t for t in candidates if _tag_step(t) <= limit]
    damaged: list[str] = [pointer_problem] if pointer_problem else []
    chosen = None
    for tag in candidates:
        if (read_integrity(ckpt_dir / tag) or {}).get("weights_only"):
            damaged.append(f"{tag}: a weights-only milestone (its optimizer state was dropped), not resumable")
            continue
        problem = verify(ckpt_dir / tag)
        if problem is None:
            chosen = tag
            break
        damaged.append(f"{tag}: {problem}")
    if chosen is None:
        if not pointer.exists():
            return Resume()  # nothing was ever completed here: a fresh start (leftovers get overwritten)
        raise ConfigError(
            f"{ckpt_dir}: no intact checkpoint to resume from ({'; '.join(damaged)}); delete {ckpt_dir} to "
            f"start the run over, or write an intact tag's name into {pointer}"
        )
    resume = Resume(tag=chosen, step=_tag_step(chosen), damaged=damaged)
    record = read_integrity(ckpt_dir / chosen) or {}
    resume.saved_dp_size, resume.saved_tp = record.get("dp_size"), record.get("tp")
    resume.finished = resume.step >= cfg.steps(1)["total"]
    check_resume_policy(cfg, ckpt_dir / chosen, resume.saved_dp_size, None if resume.finished else dp)
    return resume


# --- the resume policy: may this checkpoint continue as this config, here -----------------------------------
# ZeRO stages whose optimizer partitions `load` re-splits at another TP or DP size (pipeline.reshard, through
# DeepSpeed's universal checkpoint: its BF16_Optimizer of bf16 at stage 1 and its ZeRO optimizer otherwise).
ELASTIC_ZERO_STAGES = (1, 2)


def reshards(saved_tp: int | None, saved_dp: int | None, tp: int, dp: int) -> bool:
    """Whether a checkpoint saved at (saved_tp, saved_dp) loads at (tp, dp) through pipeline.reshard (None:
    not recorded, an older checkpoint: taken as unchanged). The trainer builds its engine for it."""
    return (saved_tp or tp, saved_dp or dp) != (tp, dp)


def check_resume_policy(cfg: Config, tag_dir: Path, saved_dp: int | None, dp: int | None) -> None:
    """The one resume policy, decided before any weights load; refuses in one line naming the key:
    - a change of the model or the data (config.MODEL_OR_DATA_KEYS; the layer spec included);
    - a change of tensor-parallel size unless the ZeRO stage (saved and now) is in ELASTIC_ZERO_STAGES;
    - a change of the training recipe (config.RECIPE_KEYS) unless checkpoint.allow_changes names it;
    - a change of data-parallel size ``saved_dp`` -> ``dp`` unless the ZeRO stage is in ELASTIC_ZERO_STAGES
      (``dp`` None: nothing will train here, e.g. the run is finished; ``saved_dp`` None: not recorded)."""
    from pipeline.config import RECIPE_KEYS

    saved_path = config_file(tag_dir)
    try:
        saved = yaml.safe_load(saved_path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(
            f"{saved_path}: unreadable ({e}); delete {tag_dir} or repoint {tag_dir.parent / LATEST}"
        ) from None
    now = cfg.to_dict()
    fresh = "start fresh in another folder (run.output_dir=... or checkpoint.dir=...)"
    changed = changed_keys(saved, now)
    stages = {_lookup(saved, "parallel.zero_stage"), cfg.parallel.zero_stage}
    if "parallel.tp" in changed and not stages <= set(ELASTIC_ZERO_STAGES):  # say why, not just that it changed
        raise ConfigError(
            f"{saved_path}: cannot resume at parallel.tp={cfg.parallel.tp}, the checkpoint was written at "
            f"parallel.tp={_lookup(saved, 'parallel.tp')}: re-splitting its weights and optimizer state for another "
            f"tensor-parallel size needs parallel.zero_stage 1 or 2 (saved at {_lookup(saved, 'parallel.zero_stage')}, "
            f"this run {cfg.parallel.zero_stage}); resume with parallel.tp={_lookup(saved, 'parallel.tp')} or {fresh}"
        )
    changed = [k for k in changed if k != "parallel.tp"]  # pipeline.reshard re-splits it at load
    if changed:
        key = changed[0]
        raise ConfigError(
            f"{saved_path}: cannot resume, {key} changed ({_lookup(saved, key)!r} -> {_lookup(now, key)!r}) and it "
            f"affects the model or data; restore it or {fresh}"
        )
    allowed = set(cfg.checkpoint.allow_changes)
    recipe = [
        k
        for k in changed_keys(saved, now, scope=RECIPE_KEYS)
        if not any(k == a or k.startswith(a + ".") for a in allowed)
    ]
    if recipe:
        key = recipe[0]
        raise ConfigError(
            f"{saved_path}: cannot resume, {key} changed ({_lookup(saved, key)!r} -> {_lookup(now, key)!r}) and it "
            f"changes the training recipe; restore it, accept it with checkpoint.allow_changes=[{key}], or {fresh}"
        )
    if saved_dp is None or dp is None or saved_dp == dp:
        return
    if cfg.parallel.zero_stage not in ELASTIC_ZERO_STAGES:
        raise ConfigError(
            f"{tag_dir}: saved at data-parallel size {saved_dp}, this run has {dp}; resuming at another DP size "
            f"is supported for parallel.zero_stage 1 and 2 only (stage {cfg.parallel.zero_stage} keeps its "
            f"optimizer state in another layout); resume with {saved_dp * cfg.parallel.tp} processes"
        )


def _lookup(d: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(d, dict):
            return None
        d = d.get(part)
    return d


# --- the train state ------------------------------------------------------------------------------------
@dataclass
class TrainState:
    """What a resume needs besides the engine's weights and optimizer. ``loader`` is this rank's data loader
    (anything with state_dict/load_state_dict); its position and the RNG states are per rank."""

    step: int = 0
    tokens_seen: int = 0
    run_id: str | None = None  # the tracking run, so a resumed run logs into the same one
    loader: Any = None
    skipper: Any = None  # pipeline.skipping.StepSkipper: its window and counters, the same on every rank

    PER_RANK = ("loader", "rng")

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "run_id": self.run_id,
            "loader": self.loader.state_dict() if self.loader is not None else None,
            "rng": _rng_state(),
            "skips": self.skipper.state_dict() if self.skipper is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.tokens_seen, self.run_id = state["step"], state["tokens_seen"], state.get("run_id")
        if self.loader is not None:
            self.loader.load_state_dict(state["loader"])
        if self.skipper is not None and state.get("skips"):  # saved before steps were skipped: a fresh window
            self.skipper.load_state_dict(state["skips"])
        _set_rng_state(state["rng"])


def _rng_state() -> dict[str, Any]:
    import torch

    from pipeline import compat

    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "megatron": compat.model_parallel_rng_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    import torch

    from pipeline import compat

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "megatron" in state:
        compat.set_model_parallel_rng_states(state["megatron"])


@contextlib.contextmanager
def rng_preserved() -> Iterator[None]:
    """Every RNG state a checkpoint holds, as it was before the block: work done between steps (lm-eval
    seeds the global generators) leaves the training trajectory as it would be without it."""
    state = _rng_state()
    try:
        yield
    finally:
        _set_rng_state(state)


# --- save / load (every rank calls these) -------------------------------------------------------------
class CheckpointWriteError(ConfigError):
    """A checkpoint could not be written (disk full, file-size limit, permissions); ``cause`` in a few words.
    The trainer's failure policy (pipeline.checkpoint_writer) decides whether the run goes on."""

    def __init__(self, message: str, cause: str = "") -> None:
        super().__init__(message)
        self.cause = cause or message


def begin_save(cfg: Config, state: TrainState) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """Every rank, before DeepSpeed writes tag ``step-NNNNNNN``: (tag, the client state with every rank's
    loader position and RNG states gathered, the integrity record's fields). A folder left under that tag
    (by a run rolled back past it, or a save that died) is removed first: two saves never mix."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    own = state.state_dict()
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, {k: own[k] for k in TrainState.PER_RANK})
    tag = tag_for(state.step)
    dp_size = parallel_state.get_data_parallel_world_size()
    client_state = {
        "tokens_seen": own["tokens_seen"],
        "run_id": own["run_id"],
        "prism": {
            "step": own["step"],
            "ranks": ranks,
            "config_hash": cfg.hash(),
            "spec": cfg.model.spec,
            "dp_size": dp_size,
            "skips": own["skips"],
        },
    }
    meta = {"step": own["step"], "tp": cfg.parallel.tp, "dp_size": dp_size, "world_size": dist.get_world_size()}
    if dist.get_rank() == 0 and (cfg.checkpoint_dir / tag).exists():
        shutil.rmtree(cfg.checkpoint_dir / tag)
    dist.barrier()
    return tag, client_state, meta


def save(engine: Any, cfg: Config, state: TrainState) -> str:
    """Write tag ``step-NNNNNNN`` for ``state.step``; the per-rank parts are gathered over all ranks.

    Order: DeepSpeed's files and config.yaml, then the integrity record, then ``latest``; a failure on any
    rank (agreed over all ranks) removes the partial folder and raises CheckpointWriteError."""
    import torch.distributed as dist

    tag, client_state, meta = begin_save(cfg, state)
    ckpt_dir = cfg.checkpoint_dir
    previous = read_latest(ckpt_dir)
    failure = None
    try:
        engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state=client_state, save_latest=False)
    except (OSError, RuntimeError) as e:
        failure = e
        dist.barrier()  # DeepSpeed's closing barrier, which the other ranks wait in, was skipped here
    try:
        if failure is None and dist.get_rank() == 0:
            write_atomic(config_file(ckpt_dir / tag), cfg.dump())
    except OSError as e:
        failure = e
    _agree_on_failure(failure, ckpt_dir, tag, previous)
    try:
        write_integrity(ckpt_dir / tag, meta)  # collective; every file is on disk (barrier in agree)
    except OSError as e:
        failure = e
    _agree_on_failure(failure, ckpt_dir, tag, previous)
    try:
        if dist.get_rank() == 0:
            write_atomic(ckpt_dir / LATEST, tag)
            prune(ckpt_dir, cfg, keep=tag)
    except OSError as e:
        failure = e
    _agree_on_failure(failure, ckpt_dir, tag, previous)
    return tag


def _agree_on_failure(failure: BaseException | None, ckpt_dir: Path, tag: str, previous: str | None) -> None:
    """A collective: if any rank failed to write, every rank raises the same one-line error (agreed_failure)."""
    cause = agreed_failure(failure, ckpt_dir, tag)
    if cause is None:
        return
    kept = f"the last good checkpoint {previous} is kept" if previous else "no earlier checkpoint exists"
    raise CheckpointWriteError(
        f"{cause} while writing checkpoint {tag} in {ckpt_dir}; {kept}; free space or point checkpoint.dir "
        f"elsewhere, then resume",
        cause=cause,
    )


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
        if read_latest(ckpt_dir) == tag:  # the pointer itself may have been the write that failed
            (Path(ckpt_dir) / LATEST).unlink(missing_ok=True)
    dist.barrier(group=group)
    return next(c for c in causes if c is not None)


# --- which tags survive: keep_last, milestones ----------------------------------------------------------
# A milestone tag says so in its integrity record ("milestone": true, set by prune right after its commit). A
# weights-only one also has "weights_only": true and lists only the files it kept ("dropped": the others):
# the record stays true to the folder, and the resume passes it over.
OPTIMIZER_FILES = ("*optim_states.pt",)  # what a weights-only milestone drops (ZeRO partitions, AdamW)


def is_milestone(step: int, keep_every_steps: int, total_steps: int) -> bool:
    """The milestone rule (step_actions forces a checkpoint there, prune keeps it): every keep_every_steps-th
    step and the last one; none when keep_every_steps is 0."""
    return keep_every_steps > 0 and (step % keep_every_steps == 0 or step == total_steps)


def prune(checkpoint_dir: Path, cfg: Config, keep: str) -> None:
    """After ``keep`` is committed (rank 0): mark it a milestone when it is one; of the other tags, the newest
    checkpoint.keep_last stay as they are, older milestones stay (weights-only when
    checkpoint.milestone_weights_only), everything else is deleted."""
    ckpt_dir, c = Path(checkpoint_dir), cfg.checkpoint
    step = _tag_step(keep)
    if step is not None and is_milestone(step, c.keep_every_steps, cfg.steps(1)["total"]):
        _update_record(ckpt_dir / keep, milestone=True)
    kept = tag_names(ckpt_dir)
    newest = set(kept[-max(1, c.keep_last) :]) | {keep}
    for tag in kept:
        if tag in newest:
            continue
        record = read_integrity(ckpt_dir / tag) or {}
        if not record.get("milestone"):
            shutil.rmtree(ckpt_dir / tag, ignore_errors=True)
        elif c.milestone_weights_only or record.get("weights_only"):
            weights_only(ckpt_dir / tag)


def weights_only(tag_dir: Path) -> None:
    """Drop a tag's optimizer files (idempotent): the record is rewritten first, without them, so a crash in
    between leaves extra files, never a record naming missing ones. Only a tag whose weights are files of
    their own (mp_rank_*_model_states.pt: ZeRO-1/2) is thinned; ZeRO-0 keeps the optimizer inside that file and
    ZeRO-3 the weights inside the optimizer's, so theirs stay full."""
    record = read_integrity(tag_dir) or {}
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
    record = read_integrity(tag_dir)
    if record is not None and any(record.get(k) != v for k, v in changes.items()):
        write_atomic(Path(tag_dir) / INTEGRITY, json.dumps({**record, **changes}, indent=1))


def milestone_tags(checkpoint_dir: Path) -> list[str]:
    """The milestone tags of a checkpoint folder, oldest first."""
    return [t for t in tag_names(checkpoint_dir) if (read_integrity(Path(checkpoint_dir) / t) or {}).get("milestone")]


UNIVERSAL = ".universal"  # <checkpoint_dir>/.universal/<tag>: a tag converted for another TP/DP size, while it loads


def load(engine: Any, cfg: Config, tag: str, state: TrainState, source_dir: Path | None = None) -> int:
    """Load tag into the engine and ``state`` (this rank's loader position and RNG states included); returns
    the data-parallel size it was saved at. ``source_dir``: the checkpoint folder holding ``tag`` when it is not
    this run's (a cooldown branch's first start: read only, a conversion goes to this run's folder).

    At another tensor- or data-parallel size than the save (ZeRO 1/2, bf16 included; the resume policy has
    allowed it): the tag is converted to DeepSpeed's universal checkpoint (pipeline.reshard, on global rank 0)
    and the engine, built with load_universal (reshards), loads its part of every weight, fp32 master and
    AdamW moment from it. The loader maps its position onto the new DP layout (data.ShardLoader), and each
    rank takes the RNG states of the saved rank with its DP rank modulo the old DP size and its TP rank modulo
    the old TP size; after a TP change megatron's model-parallel RNG keeps this rank's own seeding (a copied
    TP peer's stream would repeat that peer's dropout masks)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    load_dir = Path(source_dir or cfg.checkpoint_dir)
    tp, tag_dir = cfg.parallel.tp, load_dir / tag
    record = read_integrity(tag_dir) or {}
    saved_tp, saved_dp = record.get("tp") or tp, record.get("dp_size")
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    resharded = reshards(saved_tp, saved_dp, tp, dp)
    if resharded:
        from pipeline import reshard

        load_dir = reshard.converted(engine, cfg, tag_dir, config_file(tag_dir), cfg.checkpoint_dir / UNIVERSAL)
    try:
        path, client = engine.load_checkpoint(str(load_dir), tag=tag, load_lr_scheduler_states=False)
    finally:
        if resharded:
            dist.barrier()  # every rank has read its part
            if dist.get_rank() == 0:
                shutil.rmtree(load_dir, ignore_errors=True)
    if path is None:
        raise ConfigError(f"{tag_dir}: DeepSpeed found no checkpoint files; delete the folder to restart")
    ranks = client["prism"]["ranks"]
    saved_dp = saved_dp or len(ranks) // saved_tp
    if not resharded and len(ranks) != dist.get_world_size():
        raise ConfigError(
            f"{tag_dir}: saved by {len(ranks)} processes, this run has {dist.get_world_size()}; "
            f"resume with the same number of processes"
        )
    source = ranks[(dp_rank % saved_dp) * saved_tp + tp_rank % saved_tp]  # megatron orders ranks TP-innermost
    if saved_tp != tp:
        source = {**source, "rng": {k: v for k, v in source["rng"].items() if k != "megatron"}}
    shared = {"step": client["prism"]["step"], "tokens_seen": client["tokens_seen"], "run_id": client.get("run_id")}
    shared["skips"] = client["prism"].get("skips")
    state.load_state_dict({**shared, **source})
    return saved_dp


# --- reading weights (inference) ------------------------------------------------------------------------
@dataclass
class CheckpointInfo:
    tag_dir: Path
    step: int | None
    run_id: str | None  # the MLflow run the checkpoint belongs to, None if it had none
    client_state: dict[str, Any]  # its JSON-like part


def read_weights(tag_dir: Path, tp_rank: int | None = None) -> tuple[dict[str, Any], CheckpointInfo]:
    """(model state dict, CheckpointInfo) on the CPU: of a TP=1 tag folder (a TP checkpoint is refused), or,
    with ``tp_rank``, that TP rank's part of any tag folder."""
    import torch

    name = model_states_file(tp_rank or 0)
    if tp_rank is None:
        shards = sorted(p.name for p in Path(tag_dir).glob("mp_rank_*_model_states.pt"))
        if len(shards) > 1:
            raise ConfigError(
                f"{tag_dir}: {len(shards)} model shards (a tensor-parallel checkpoint); inference loads TP=1 "
                "checkpoints only; retrain or convert with parallel.tp=1"
            )
    if not (Path(tag_dir) / name).is_file():
        raise ConfigError(f"{tag_dir}: {name} is missing (an incomplete checkpoint); use another checkpoint of the run")
    want = ((read_integrity(tag_dir) or {}).get("files") or {}).get(name)
    size = (Path(tag_dir) / name).stat().st_size
    if want is not None and want["size"] != size:
        raise ConfigError(
            f"{tag_dir}: {name} has {size} bytes, its integrity record says {want['size']} (truncated); "
            f"use another checkpoint of the run"
        )
    state = torch.load(Path(tag_dir) / name, map_location="cpu", weights_only=False)
    weights = state.pop("module")
    if next(iter(weights)).startswith("module."):  # saved from a wrapper
        weights = {k.removeprefix("module."): v for k, v in weights.items()}
    client_state = _plain_copy(state)
    step = (client_state.get("prism") or {}).get("step", client_state.get("global_steps"))
    info = CheckpointInfo(
        Path(tag_dir), int(step) if step is not None else None, client_state.get("run_id"), client_state
    )
    return weights, info


def _plain_copy(value: Any) -> Any:
    """The JSON-like part of the client state (drops tensors, numpy RNG states and the like)."""
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    if isinstance(value, dict):
        kept = {str(k): _plain_copy(v) for k, v in value.items()}
        return {k: v for k, v in kept.items() if v is not _DROP}
    if isinstance(value, list | tuple):
        kept = [_plain_copy(v) for v in value]
        return [v for v in kept if v is not _DROP]
    return _DROP


_DROP = object()

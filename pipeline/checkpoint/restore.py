"""Where a run resumes, whether that checkpoint may continue as this config, the train state a checkpoint
carries (step, tokens, loader positions, RNG states), and loading a tag into an engine. Before a resume the
integrity record is checked; a damaged newest checkpoint falls back to the newest intact one kept."""

from __future__ import annotations

import contextlib
import random
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from pipeline import checkpoint
from pipeline.atomic import folder_write_problem
from pipeline.config import Config, ConfigError, changed_keys


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
    _, world = checkpoint.rank_and_world()
    dp = world // cfg.parallel.tp if world % cfg.parallel.tp == 0 else None
    check_writable(ckpt_dir)
    pointer = ckpt_dir / checkpoint.LATEST
    named, limit, pointer_problem = checkpoint.read_latest(ckpt_dir), None, None
    if named is not None:
        if checkpoint.tag_step(named) is None:
            pointer_problem = f"{pointer} holds {named!r}, not a checkpoint tag"
            named = None
        elif not (ckpt_dir / named).is_dir():
            pointer_problem = f"{pointer} names {named}, which does not exist"
            named = None
        else:
            limit = checkpoint.tag_step(named)
    candidates = checkpoint.tag_names(ckpt_dir)[::-1]  # newest first
    if limit is not None:  # a user may repoint `latest` at an older tag to roll back: respect it
        candidates = [t for t in candidates if checkpoint.tag_step(t) <= limit]
    damaged: list[str] = [pointer_problem] if pointer_problem else []
    chosen = None
    for tag in candidates:
        if (checkpoint.read_integrity(ckpt_dir / tag) or {}).get("weights_only"):
            damaged.append(f"{tag}: a weights-only milestone (its optimizer state was dropped), not resumable")
            continue
        problem = checkpoint.verify(ckpt_dir / tag)
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
    resume = Resume(tag=chosen, step=checkpoint.tag_step(chosen), damaged=damaged)
    record = checkpoint.read_integrity(ckpt_dir / chosen)  # verified above: it exists
    resume.saved_dp_size, resume.saved_tp = record["dp_size"], record["tp"]
    resume.finished = resume.step >= cfg.steps(1)["total"]
    check_resume_policy(cfg, ckpt_dir / chosen, resume.saved_dp_size, None if resume.finished else dp)
    return resume


# --- the resume policy: may this checkpoint continue as this config, here -----------------------------------
# ZeRO stages whose optimizer partitions `load` re-splits at another TP or DP size (pipeline.checkpoint.reshard, through
# DeepSpeed's universal checkpoint: its BF16_Optimizer of bf16 at stage 1 and its ZeRO optimizer otherwise).
ELASTIC_ZERO_STAGES = (1, 2)


def reshards(saved_tp: int, saved_dp: int, tp: int, dp: int) -> bool:
    """Whether a checkpoint saved at (saved_tp, saved_dp) (its integrity record) loads at (tp, dp) through
    pipeline.checkpoint.reshard. The trainer builds its engine for it."""
    return (saved_tp, saved_dp) != (tp, dp)


def check_resume_policy(cfg: Config, tag_dir: Path, saved_dp: int, dp: int | None) -> None:
    """The one resume policy, decided before any weights load; refuses in one line naming the key:
    - a change of the model or the data (config.MODEL_OR_DATA_KEYS; the layer spec included);
    - a change of tensor-parallel size unless the ZeRO stage (saved and now) is in ELASTIC_ZERO_STAGES;
    - a change of the training recipe (config.RECIPE_KEYS) unless checkpoint.allow_changes names it;
    - a change of data-parallel size ``saved_dp`` -> ``dp`` unless the ZeRO stage is in ELASTIC_ZERO_STAGES
      (``dp`` None: nothing will train here, e.g. the run is finished)."""
    from pipeline.config import RECIPE_KEYS

    saved_path = checkpoint.config_file(tag_dir)
    try:
        saved = yaml.safe_load(saved_path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(
            f"{saved_path}: unreadable ({e}); delete {tag_dir} or repoint {tag_dir.parent / checkpoint.LATEST}"
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
    changed = [k for k in changed if k != "parallel.tp"]  # pipeline.checkpoint.reshard re-splits it at load
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
    if dp is None or saved_dp == dp:
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
        if self.skipper is not None:
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


UNIVERSAL = ".universal"  # <checkpoint_dir>/.universal/<tag>: a tag converted for another TP/DP size, while it loads


def load(engine: Any, cfg: Config, tag: str, state: TrainState, source_dir: Path | None = None) -> int:
    """Load tag into the engine and ``state`` (this rank's loader position and RNG states included); returns
    the data-parallel size it was saved at. ``source_dir``: the checkpoint folder holding ``tag`` when it is not
    this run's (a cooldown branch's first start: read only, a conversion goes to this run's folder).

    At another tensor- or data-parallel size than the save (ZeRO 1/2, bf16 included; the resume policy has
    allowed it): the tag is converted to DeepSpeed's universal checkpoint (pipeline.checkpoint.reshard, on global rank 0)
    and the engine, built with load_universal (reshards), loads its part of every weight, fp32 master and
    AdamW moment from it. The loader maps its position onto the new DP layout (data.ShardLoader), and each
    rank takes the RNG states of the saved rank with its DP rank modulo the old DP size and its TP rank modulo
    the old TP size; after a TP change megatron's model-parallel RNG keeps this rank's own seeding (a copied
    TP peer's stream would repeat that peer's dropout masks)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    load_dir = Path(source_dir or cfg.checkpoint_dir)
    tp, tag_dir = cfg.parallel.tp, load_dir / tag
    record = checkpoint.read_integrity(tag_dir)  # the resume verified it (or a cooldown branch's start)
    saved_tp, saved_dp = record["tp"], record["dp_size"]
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    resharded = reshards(saved_tp, saved_dp, tp, dp)
    if resharded:
        from pipeline.checkpoint import reshard

        load_dir = reshard.converted(
            engine, cfg, tag_dir, checkpoint.config_file(tag_dir), cfg.checkpoint_dir / UNIVERSAL
        )
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
    if not resharded and len(ranks) != dist.get_world_size():
        raise ConfigError(
            f"{tag_dir}: saved by {len(ranks)} processes, this run has {dist.get_world_size()}; "
            f"resume with the same number of processes"
        )
    source = ranks[(dp_rank % saved_dp) * saved_tp + tp_rank % saved_tp]  # megatron orders ranks TP-innermost
    if saved_tp != tp:
        source = {**source, "rng": {k: v for k, v in source["rng"].items() if k != "megatron"}}
    shared = {"step": client["prism"]["step"], "tokens_seen": client["tokens_seen"], "run_id": client.get("run_id")}
    shared["skips"] = client["prism"]["skips"]
    state.load_state_dict({**shared, **source})
    return saved_dp

"""Resume at another tensor- or data-parallel size, through DeepSpeed's universal checkpoint.

A checkpoint's ZeRO files hold each (TP rank, DP rank)'s flat partition of the fp32 master weights and the
AdamW moments. DeepSpeed's converter (``python -m deepspeed.checkpoint.ds_to_universal``, its public CLI)
writes every parameter whole (fp32, exp_avg, exp_avg_sq, step) once it is told how each one is split over
TP ranks; an engine built with ``"checkpoint": {"load_universal": true}`` then cuts out its own part for its
TP and DP size, and copies the masters into the module's weights. Prism supplies what the converter expects
from Megatron-DeepSpeed's client code, in a staging copy of the model-state files (so checkpoints written
before this module existed convert as well):
- ``universal_checkpoint_info``: the TP split of every parameter, from pipeline.model.tp_layout (the replicated
  attention of indivisible layers included), as the exact-name patterns DeepSpeed matches;
- megatron-core's module state holds ``_extra_state`` entries that are None, and the converter's copy of the
  module weights calls ``.float()`` on every entry (AttributeError): the staging copy leaves them out.

The vocabulary rows are padded to a multiple of 128 x TP (pipeline.model_size.padded_vocab), and the padding
rows take part in the softmax: the rows both sizes have are kept, rows the new size adds start at zero.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from pipeline.config import Config, ConfigError

STAGING = ".staging"  # beside the universal folder while it is converted


def universal_info(param_shapes: dict[str, tuple[int, ...]], saved: Config, now: Config) -> dict:
    """DeepSpeed's universal_checkpoint_info for a checkpoint of ``saved`` whose parameters (name -> shape of
    one TP rank's part) are ``param_shapes``, to be loaded as ``now``: one exact-name pattern per parameter in
    the list of its TP split (a column-parallel one needs none: DeepSpeed joins over rows by default)."""
    from deepspeed.checkpoint import constants as c

    from pipeline import model_size
    from pipeline.model.tp_layout import tp_split

    lists: dict[str, list[str]] = {
        c.TP_REPLICATED_PARAMETER_PATTERNS: [],
        c.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: [],
        c.PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0: [],
        c.VOCABULARY_PARAMETER_PATTERNS: [],
    }
    for name in param_shapes:
        split, pattern = tp_split(name, saved), re.escape(name) + r"\Z"
        if split.dim is None:
            lists[c.TP_REPLICATED_PARAMETER_PATTERNS].append(pattern)
        elif split.dim == 1:
            lists[c.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS].append(pattern)
        elif split.halves:
            lists[c.PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0].append(pattern)
        if split.vocab:
            lists[c.VOCABULARY_PARAMETER_PATTERNS].append(pattern)
    # DeepSpeed cuts vocab rows to this and pads with zeros to the new size: keep every row both sizes have
    rows = min(model_size.padded_vocab(saved), model_size.padded_vocab(now))
    return {**lists, c.ORIGINAL_VOCAB_SIZE: rows}


def stage(tag_dir: Path, staging: Path, saved: Config, now: Config) -> None:
    """The converter's input: the optimizer files linked, the model-state files rewritten with the
    universal_checkpoint_info and without megatron's non-tensor module entries."""
    import torch
    from deepspeed.checkpoint.constants import PARAM_SHAPES, UNIVERSAL_CHECKPOINT_INFO

    staging.mkdir(parents=True)
    for path in sorted(tag_dir.glob("*_optim_states.pt")):
        (staging / path.name).symlink_to(path.resolve())
    for path in sorted(tag_dir.glob("mp_rank_*_model_states.pt")):
        state = torch.load(path, map_location="cpu", weights_only=False)
        state["module"] = {k: v for k, v in state["module"].items() if torch.is_tensor(v)}
        shapes = {name: tuple(shape) for group in state[PARAM_SHAPES] for name, shape in group.items()}
        state[UNIVERSAL_CHECKPOINT_INFO] = universal_info(shapes, saved, now)
        torch.save(state, staging / path.name)


def to_universal(tag_dir: Path, out: Path, saved: Config, now: Config) -> None:
    """Write the universal checkpoint of tag folder ``tag_dir`` (trained as ``saved``) to ``out`` for a run of
    ``now`` (one process; a failure is one line naming the cause, and nothing is left at ``out``)."""
    tag_dir, out = Path(tag_dir), Path(out)
    staging = out.parent / STAGING / tag_dir.name
    for leftover in (out, staging):  # from a conversion killed half-way
        shutil.rmtree(leftover, ignore_errors=True)
    command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(staging)]
    command += ["--output_folder", str(out), "--num_extract_workers", "1", "--num_merge_workers", "1"]
    try:
        stage(tag_dir, staging, saved, now)
        done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    except OSError as e:
        done, cause = None, f"{type(e).__name__}: {e}"
    finally:
        shutil.rmtree(staging.parent, ignore_errors=True)
    if done is not None and done.returncode == 0:
        return
    shutil.rmtree(out, ignore_errors=True)
    if out.parent.is_dir() and not any(out.parent.iterdir()):
        out.parent.rmdir()
    if done is not None:
        lines = [line for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        cause = lines[-1] if lines else f"exit {done.returncode}"
    raise ConfigError(
        f"{tag_dir}: converting it to DeepSpeed's universal checkpoint (to resume at another TP or DP size) "
        f"failed: {cause}; resume at the sizes it was saved at (parallel.tp={saved.parallel.tp}), or if the disk "
        f"is full, free space in {out.parent}"
    )


def converted(engine: Any, now: Config, tag_dir: Path, saved_config: Path, load_dir: Path) -> Path:
    """Collective: global rank 0 converts ``tag_dir`` (trained with the config in ``saved_config``: its TP
    size, the layers it replicated) into ``load_dir``; every rank returns ``load_dir`` or raises the same
    one-line error. The engine must have been built with load_universal (checkpoint.restore.reshards)."""
    import torch.distributed as dist
    import yaml

    from pipeline.config import from_dict

    if not engine.load_universal_checkpoint():
        raise RuntimeError(
            "pipeline/checkpoint/reshard.py: the engine was built without load_universal, but this resume changes the TP "
            "or DP size; pipeline.train.engine.build_engine must be told checkpoint.restore.reshards(...)"
        )
    failure: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            saved = from_dict(yaml.safe_load(Path(saved_config).read_text()), str(saved_config))
            to_universal(tag_dir, Path(load_dir) / Path(tag_dir).name, saved, now)
        except Exception as e:  # noqa: BLE001 - the other ranks must hear of any failure, not wait for ever
            failure = e
    said = [None if failure is None else str(failure) if isinstance(failure, ConfigError) else repr(failure)]
    dist.broadcast_object_list(said, src=0)
    if failure is not None:
        raise failure
    if said[0] is not None:
        raise ConfigError(said[0])
    return Path(load_dir)

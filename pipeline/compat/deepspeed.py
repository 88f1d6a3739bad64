"""DeepSpeed adapters, and the private DeepSpeed code Prism copies, behind an exact version check.

Adapters (public API only): the ``mpu`` object deepspeed.initialize asks for (MegatronMpu), and
import_deepspeed (CPU accelerator, JIT cache, no shm comm-op build on CPU, quiet logs).

Copied code: DeepSpeed's bf16 / ZeRO-1/2 optimizer step without its host reads (remove_host_syncs). It
mirrors private DeepSpeed code of one release, DEEPSPEED_MIRRORED, which pyproject.toml pins exactly. On any
other release the copy is not used: remove_host_syncs leaves DeepSpeed's own step (correct, with its host
syncs) and says so in one warning line. After an upgrade: re-mirror, run tests/integration/test_host_sync.py,
then move the pin and DEEPSPEED_MIRRORED.

Private behaviour relied on (not copied): save_checkpoint writes every file through
``engine.checkpoint_engine.save``, which stage_checkpoint_writes wraps so the files can be written in the
background; on another release saves stay synchronous (one warning line).

A resume at another TP or DP size goes through DeepSpeed's public universal checkpoint (pipeline.checkpoint.reshard),
not through copied code."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from pipeline.compat.megatron import cuda_available

log = logging.getLogger(__name__)

# The DeepSpeed release the copied code below mirrors; pyproject.toml pins deepspeed==this.
DEEPSPEED_MIRRORED = "0.19.8"
_WARNED_FALLBACK = False


def installed_deepspeed() -> str:
    """The installed DeepSpeed release, without a local build label (0.19.8+abc123 is 0.19.8, as for pip)."""
    import deepspeed

    return deepspeed.__version__.split("+")[0]


# ======================================================================================================
# Adapters: the mpu object, the import with our defaults.
# ======================================================================================================
class MegatronMpu:
    """The ``mpu`` object ``deepspeed.initialize`` expects, answered from megatron's parallel_state.

    parallel_state lacks get_model_parallel_rank/world_size (AttributeError inside DeepSpeed). Passing no mpu
    at TP>1 is worse: DeepSpeed then all-reduces over the whole world and counts every TP shard as a
    replica, so the grad norm (and the clipping) is silently wrong. TP is our only model-parallel dimension
    (no pipeline parallelism), so "model parallel" == "tensor parallel" here.
    """

    def __init__(self) -> None:
        from megatron.core import parallel_state

        self.ps = parallel_state

    def get_model_parallel_rank(self) -> int:
        return self.ps.get_tensor_model_parallel_rank()

    def get_model_parallel_world_size(self) -> int:
        return self.ps.get_tensor_model_parallel_world_size()

    def get_model_parallel_group(self):
        return self.ps.get_tensor_model_parallel_group()

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.ps.get_tensor_model_parallel_src_rank()

    def get_data_parallel_rank(self) -> int:
        return self.ps.get_data_parallel_rank()

    def get_data_parallel_world_size(self) -> int:
        return self.ps.get_data_parallel_world_size()

    def get_data_parallel_group(self):
        return self.ps.get_data_parallel_group()

    def get_data_parallel_group_ranks(self) -> list[int]:
        return torch.distributed.get_process_group_ranks(self.get_data_parallel_group())


def pre_step_grad_norm(wrapper: Any) -> Any:
    """The global grad norm (before clipping) of the step DeepSpeed's optimizer wrapper is taking, when it calls
    the torch optimizer's ``step``: BF16_Optimizer, ZeRO-1/2 and ZeRO-3 set their private ``_global_grad_norm``
    (a device tensor; a Python inf after their own overflow skip) before that call. None where the wrapper
    keeps none (ZeRO-0, where the engine steps the torch optimizer itself)."""
    return getattr(wrapper, "_global_grad_norm", None)


def import_deepspeed():
    """Import DeepSpeed with our defaults: CPU accelerator without CUDA, a persistent JIT cache, and no
    shared-memory comm-op build on CPU (a g++ JIT on first use; gloo does the collectives anyway)."""
    import importlib
    import sys

    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    if not cuda_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    if not cuda_available():
        # `import deepspeed.comm.torch as m` yields the torch package (deepspeed.comm re-exports a name
        # `torch`), so patch the module object itself before the first init_distributed builds the op.
        importlib.import_module("deepspeed.comm.torch")
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    # deepspeed.initialize asserts LOCAL_RANK is set; a plain single process (gloo world of 1) has none.
    dist = torch.distributed
    if "LOCAL_RANK" not in os.environ and dist.is_initialized() and dist.get_world_size() == 1:
        os.environ["LOCAL_RANK"] = "0"
    # bf16 with fp32 gradient accumulation runs DeepSpeed's BF16_Optimizer (ZeRO-1), which prints six
    # forced memory reports to stdout while it builds; the console gets our lines only.
    from deepspeed.runtime import bf16_optimizer

    bf16_optimizer.see_memory_usage = lambda *args, **kwargs: None
    for name in ("DeepSpeed", "deepspeed"):  # DeepSpeed logs every step at INFO otherwise
        logging.getLogger(name).setLevel(logging.WARNING)
    return deepspeed


def remove_host_syncs(optimizer: Any) -> None:
    """Make the DeepSpeed optimizer wrapper's step read nothing on the host, where we know how (bf16 / fp32
    under ZeRO-1/2; the plain torch optimizer of ZeRO-0 reads nothing already). One sync remains for fp32
    ZeRO-1/2, see zero_clip_without_host_reads. On a DeepSpeed other than DEEPSPEED_MIRRORED: nothing is
    replaced, DeepSpeed's own step runs, and one warning line says so."""
    global _WARNED_FALLBACK
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    installed = installed_deepspeed()
    if installed != DEEPSPEED_MIRRORED:
        dist = torch.distributed
        if not _WARNED_FALLBACK and (not dist.is_initialized() or dist.get_rank() == 0):
            log.warning(
                "prism: warning: DeepSpeed %s is installed, pipeline/compat/deepspeed.py mirrors %s's optimizer "
                "step: DeepSpeed's own step runs (correct, with its host syncs); pip install deepspeed==%s "
                "for the sync-free one",
                installed,
                DEEPSPEED_MIRRORED,
                DEEPSPEED_MIRRORED,
            )
        _WARNED_FALLBACK = True
        return
    if isinstance(optimizer, BF16_Optimizer):  # bf16 + fp32 gradient accumulation, ZeRO-1
        sync_free_bf16_step(optimizer)
    elif isinstance(optimizer, DeepSpeedZeroOptimizer):  # ZeRO-2 bf16, ZeRO-1/2 fp32
        zero_clip_without_host_reads(optimizer)


# ======================================================================================================
# The optimizer step without host reads: copied from DEEPSPEED_MIRRORED (remove_host_syncs checks it).
# ======================================================================================================
# Attributes of DeepSpeed's BF16_Optimizer that sync_free_bf16_step's replacement step reads or calls.
_BF16_STEP_USES = (
    "get_grads_for_norm",
    "mpu",
    "norm_type",
    "has_moe_layers",
    "clip_grad",
    "fp32_groups_gradients_flat",
    "fp32_groups_flat_partition",
    "fp32_groups_gradient_flat_partition",
    "_uses_muon",
    "_prepare_muon_updates",
    "optimizer",
    "grad_acc_dtype",
    "_lazy_init_hp_params_optimizer_state",
    "update_lp_params",
    "clear_hp_grads",
)


def sync_free_bf16_step(optimizer: Any) -> None:
    """Replace ``step`` on this DeepSpeed ``BF16_Optimizer`` instance (not the class) by one that makes the same
    update without reading anything on the host.

    Mirrors ``BF16_Optimizer.step`` of DeepSpeed 0.19.8 line by line except for two ``if``s on device values,
    each a host sync per optimizer step (the GPU waits idle for the CPU to queue the next step):
      - ``if is_invalid_grad_norm(norm)``: skip the update of a NaN/inf step. Here no branch: a NaN/inf norm
        (get_global_norm_of_tensors masks it to -1) gives a clip coefficient of 0 and the gradients are made
        finite, so the update is made with zero gradients instead of skipped: the parameters stay finite, but
        AdamW still decays its moments and counts the step (the trainer stops at the next read-back, exit 4,
        and never checkpoints after such a step). ``_global_grad_norm`` is then inf on the device, and
        ``overflow`` stays False (the engine's ``skipped_steps`` does not count the step; we don't read it).
      - ``if clip_coef < 1`` in clip_tensors_by_global_norm: the coefficient min(1, max_norm / (norm + 1e-6))
        (the same formula and eps) is multiplied in always; a factor of exactly 1.0 leaves the gradients as
        they are, so the update is bit-identical to DeepSpeed's.
    The fp32 gradient link, the optimizer step, lazy state init, the grad_acc_dtype cast and muon are
    DeepSpeed's own code paths. After a DeepSpeed upgrade, re-mirror its step here;
    tests/integration/test_host_sync.py compares this step's parameters with the installed DeepSpeed's own.
    """
    missing = [name for name in _BF16_STEP_USES if not hasattr(optimizer, name)]
    if missing:
        raise RuntimeError(
            f"pipeline/compat/deepspeed.py sync_free_bf16_step: DeepSpeed's {type(optimizer).__name__} lacks {missing}; "
            "its step changed, re-mirror it in sync_free_bf16_step"
        )
    import types

    optimizer.step = types.MethodType(_bf16_step_without_host_reads, optimizer)


@torch.no_grad()
def _bf16_step_without_host_reads(self: Any, closure: Any = None) -> None:
    from deepspeed.runtime.utils import get_global_norm_of_tensors, get_norm_with_moe_layers

    if closure is not None:
        raise NotImplementedError(f"{type(self).__name__}.step takes no closure")

    self.overflow = False  # not known on the host without a sync (see sync_free_bf16_step)
    non_expert_grads_for_norm, expert_grads_for_norm = self.get_grads_for_norm()
    non_expert_groups_norm = get_global_norm_of_tensors(
        input_tensors=non_expert_grads_for_norm, mpu=self.mpu, norm_type=self.norm_type
    )
    all_groups_norm = non_expert_groups_norm
    if self.has_moe_layers:
        all_groups_norm = get_norm_with_moe_layers(
            non_expert_groups_norm, mpu=self.mpu, expert_tensors=expert_grads_for_norm, norm_type=self.norm_type
        )

    # DeepSpeed: `if is_invalid_grad_norm(norm)` -> inf norm, clear the grads, return; `if clip_coef < 1` -> clip
    # Differs from DeepSpeed on purpose: a NaN/inf step updates the moments with zero gradients, where
    # DeepSpeed skips the step.
    invalid = ~torch.isfinite(all_groups_norm) | (all_groups_norm < 0)
    self._global_grad_norm = torch.where(invalid, float("inf"), all_groups_norm)
    clip_coef = torch.ones_like(all_groups_norm)
    if self.clip_grad > 0.0:
        clip_coef = (self.clip_grad / (all_groups_norm + 1e-6)).clamp(max=1.0)  # clip_tensors_by_global_norm's
    clip_coef = torch.where(invalid, 0.0, clip_coef)
    # The flat buffers hold every gradient DeepSpeed clips (per-parameter views into them) plus zeros (padding,
    # parameters without a gradient this step): one kernel each instead of one per parameter. nan_to_num after
    # the multiply: 0 * inf is NaN.
    for flat_gradients in self.fp32_groups_gradients_flat:
        flat_gradients.mul_(clip_coef).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)

    for param_partition, grad_partition in zip(
        self.fp32_groups_flat_partition, self.fp32_groups_gradient_flat_partition
    ):
        # the torch optimizer steps fp32 weights: gradients accumulated in bf16 are upcast for it
        param_partition.grad = (
            grad_partition.to(param_partition.dtype)
            if grad_partition.dtype != param_partition.dtype
            else grad_partition
        )

    if self._uses_muon:
        self._prepare_muon_updates()
    self.optimizer.step()

    if self.grad_acc_dtype is not torch.float32:
        for param_partition in self.fp32_groups_flat_partition:
            param_partition.grad = None

    # the torch optimizer's state exists from its first step on: link it to each parameter's fragment
    self._lazy_init_hp_params_optimizer_state()

    self.update_lp_params()

    self.clear_hp_grads()


def zero_clip_without_host_reads(optimizer: Any) -> None:
    """Replace ``unscale_and_clip_grads`` on this DeepSpeed ``DeepSpeedZeroOptimizer`` instance (ZeRO-1/2
    without BF16_Optimizer) by one without the host read of DeepSpeed 0.19.8's, which it mirrors otherwise.

    DeepSpeed's does ``if is_invalid_grad_norm(norm): norm = inf`` once per param group and step; here
    torch.where does it on the device, so the scale is the same and the update bit-identical. A NaN/inf norm
    gives a scale of 0, and the gradients are then made finite (DeepSpeed's 0 * NaN would leave NaN
    gradients and poison the parameters, as in bf16 the step does not skip such a step): the parameters stay
    finite and ``_global_grad_norm`` is inf (its own combine_grad_norm_groups). Not removed: in fp32 (not
    bf16) ``step`` itself reads ``is_invalid_grad_norm`` once to skip a NaN step; changing that means
    mirroring the whole 150-line step (offload, muon, zenflow), for a precision only CPU runs use. Nor with
    train.grad_clip=0 in bf16: DeepSpeed then returns before scaling, and NaN gradients reach the weights.
    """
    missing = [name for name in ("clip_grad", "loss_scale") if not hasattr(optimizer, name)]
    if missing or not hasattr(type(optimizer), "unscale_and_clip_grads"):
        raise RuntimeError(
            f"pipeline/compat/deepspeed.py zero_clip_without_host_reads: DeepSpeed's {type(optimizer).__name__} lacks "
            f"{missing or ['unscale_and_clip_grads']}; re-mirror its unscale_and_clip_grads there"
        )
    import types

    optimizer.unscale_and_clip_grads = types.MethodType(_zero_unscale_and_clip_without_host_reads, optimizer)


def _zero_unscale_and_clip_without_host_reads(self: Any, grad_groups_flat: list, total_norm: Any) -> None:
    if self.clip_grad == 0.0 and self.loss_scale == 1.0:
        return

    combined_scale = self.loss_scale
    # Differs from DeepSpeed on purpose: a NaN/inf norm leaves zero gradients (the moments then update with
    # zeros), where DeepSpeed's scale of 0 keeps the NaNs.
    if self.clip_grad > 0.0:
        # DeepSpeed: `if is_invalid_grad_norm(clip_norm): clip_norm = inf` (the -1 sentinel of a NaN/inf norm)
        total_norm = torch.as_tensor(total_norm, dtype=torch.float32)  # a float from a direct caller too
        invalid = ~torch.isfinite(total_norm) | (total_norm < 0)
        clip_norm = torch.where(invalid, float("inf"), total_norm)
        # the norm of the loss-scaled gradients (the scale is 1 in bf16 and fp32)
        clip = ((clip_norm / self.loss_scale) + 1e-6) / self.clip_grad
        clip = torch.clamp(clip, min=1.0)
        combined_scale = clip * self.loss_scale

    for grad in grad_groups_flat:
        for g in grad if isinstance(grad, list) else [grad]:
            # an invalid norm scales by 1/inf = 0; nan_to_num after it, as 0 * inf is NaN
            g.data.mul_(1.0 / combined_scale).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)


# ======================================================================================================
# Non-blocking checkpoint writes: DeepSpeed's own files, written later.
# ======================================================================================================
def stage_checkpoint_writes(engine: Any) -> StagingCheckpointEngine | None:
    """Make ``engine.save_checkpoint`` stage every file in host memory instead of writing it, so the
    caller can write them in the background (pipeline.checkpoint.writer) with DeepSpeed's exact layout.

    Relies on DeepSpeed 0.19.8 private behaviour: save_checkpoint hands every file's state dict to
    ``engine.checkpoint_engine.save(state, path)`` (read at save time, not cached), and those dicts alias live
    parameters and optimizer tensors. On another release: None and one warning line (saves stay synchronous)."""
    global _WARNED_STAGING
    if installed_deepspeed() != DEEPSPEED_MIRRORED:
        if not _WARNED_STAGING:
            log.warning(
                "DeepSpeed %s is not %s: checkpoints are written synchronously (checkpoint.async_save has no "
                "effect until pipeline.compat.deepspeed is checked against this release)",
                installed_deepspeed(),
                DEEPSPEED_MIRRORED,
            )
            _WARNED_STAGING = True
        return None
    if not isinstance(engine.checkpoint_engine, StagingCheckpointEngine):
        engine.checkpoint_engine = StagingCheckpointEngine(engine.checkpoint_engine)
    return engine.checkpoint_engine


_WARNED_STAGING = False


class StagingCheckpointEngine:
    """DeepSpeed's checkpoint engine with ``save`` deferred: the state dict is copied to host memory (pinned
    buffers on CUDA, kept between saves: one save is in flight at a time) and queued; ``take_staged``
    returns the queue once the copies are done, ``write`` torch.saves one entry as DeepSpeed would have.
    Everything else (load, makedirs, commit, ...) is the wrapped engine's."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.staged: list[tuple[str, Any]] = []
        self._host: dict[tuple[str, int], Any] = {}  # (file name, n-th storage) -> its reused host storage

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def save(self, state_dict: Any, path: str) -> None:
        copies: dict[Any, Any] = {}  # a tensor referenced twice (tied weights) is copied once, a storage too
        self.staged.append((path, self._to_host(state_dict, os.path.basename(path), copies)))

    def commit(self, info: Any) -> bool:
        return True  # the files are not written yet: pipeline.checkpoint.writer commits them

    def take_staged(self) -> list[tuple[str, Any]]:
        """The staged (path, host state dict) pairs; waits for the device-to-host copies to finish."""
        if cuda_available():
            torch.cuda.current_stream().synchronize()
        staged, self.staged = self.staged, []
        return staged

    def write(self, state: Any, path: str) -> None:
        torch.save(state, path, _use_new_zipfile_serialization=self.inner.zipfile_serialization)

    def _to_host(self, value: Any, name: str, copies: dict[Any, Any]) -> Any:
        if isinstance(value, torch.Tensor):
            if id(value) not in copies:
                copies[id(value)] = self._host_copy(value, name, copies)
            return copies[id(value)]
        if isinstance(value, dict):
            host = type(value)((k, self._to_host(v, name, copies)) for k, v in value.items())
            if hasattr(value, "__dict__"):  # a state dict's _metadata (module versions) is pickled too
                host.__dict__.update(value.__dict__)
            return host
        if isinstance(value, list):
            return [self._to_host(v, name, copies) for v in value]
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            items = [self._to_host(v, name, copies) for v in value]
            return value if all(a is b for a, b in zip(items, value, strict=True)) else tuple(items)
        return value  # ints, strings, configs, numpy RNG states: fresh or never changed by a step

    def _host_copy(self, t: torch.Tensor, name: str, copies: dict[Any, Any]) -> torch.Tensor:
        """A host view of ``t`` over a host copy of its whole storage, made once per storage: views that share
        a storage (a flat parameter buffer) still share one, with the same offsets, and the copy keeps
        requires_grad, so torch.save writes the file DeepSpeed would have written from these tensors."""
        requires_grad, t = t.requires_grad, t.detach()
        storage = t.untyped_storage()
        if ("storage", storage.data_ptr()) not in copies:
            key = (name, sum(k[0] == "storage" for k in copies if isinstance(k, tuple)))
            buf = self._host.get(key)
            if buf is None or buf.nbytes() != storage.nbytes():
                pinned = torch.empty(storage.nbytes(), dtype=torch.uint8, device="cpu", pin_memory=t.is_cuda)
                buf = self._host[key] = pinned.untyped_storage()
            copies[("storage", storage.data_ptr())] = buf.copy_(storage, non_blocking=t.is_cuda)
        host = copies[("storage", storage.data_ptr())]
        view = torch.empty(0, dtype=t.dtype).set_(host, t.storage_offset(), t.size(), t.stride())
        return view.requires_grad_(requires_grad)

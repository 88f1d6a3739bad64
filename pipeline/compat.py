"""Every megatron-core (and, below, DeepSpeed) quirk in one place.

Megatron-core assumes CUDA in a few spots (listed below). On a CPU-only torch we swap in small
CPU equivalents, and only then: with CUDA present nothing here patches anything.

  1. `model_parallel_cuda_manual_seed` / the RNG tracker use `torch.cuda` RNG states -> a CPU tracker;
  2. `get_global_memory_buffer()` allocates on the current CUDA device -> a CPU buffer;
  3. the default causal mask in fused_softmax is built on "cuda" -> built on the CPU;
  4. `RotaryEmbedding.get_emb` moves `inv_freq` to CUDA -> not used: pipeline.model builds its own
     rotary table per head dim (one per d_h, the Prism layers differ), on the activations' device.

Checkpoints read and restore the RNG tracker's states through here too (model_parallel_rng_states).

Versions: 0.16.x (Python 3.11) and 0.19.x (Python 3.12) are tested; what differs between them is handled
here (self_attention_extra_kwargs). GPTModel's forward ends at the final hidden states
(output_layer_returns_hidden_states). DeepSpeed 0.19.8: its bf16 / ZeRO step is mirrored without host reads
(remove_host_syncs) and its optimizer partitions are re-split for elastic resume.

Process groups, devices and collectives are plumbing, not quirks: pipeline.distributed.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

import torch

log = logging.getLogger(__name__)

_CPU_SHIMS_APPLIED = False
_CPU_DEVICE_CHOSEN = False  # train.device=cpu on a host with a GPU: behave as on a CPU-only torch


def use_cpu_device() -> None:
    """Train on the CPU although CUDA is there (pipeline.distributed calls it for train.device=cpu)."""
    global _CPU_DEVICE_CHOSEN
    _CPU_DEVICE_CHOSEN = True


def cuda_available() -> bool:
    return torch.cuda.is_available() and not _CPU_DEVICE_CHOSEN


def apply_cpu_shims() -> None:
    """Patch the CUDA-only spots of megatron-core with CPU versions (idempotent; no-op with CUDA)."""
    global _CPU_SHIMS_APPLIED
    if _CPU_SHIMS_APPLIED or cuda_available():
        return
    from megatron.core.fusions import fused_softmax

    def causal_mask_cpu(sq: int) -> torch.Tensor:
        return torch.ones(sq, sq, dtype=torch.bool).triu_(diagonal=1)

    # fused_softmax imported the function by name, so patch that module's binding (shim 3).
    fused_softmax.get_default_causal_mask = causal_mask_cpu
    _CPU_SHIMS_APPLIED = True


def _install_cpu_memory_buffer() -> None:
    """Shim 2: the buffer DotProductAttention takes its score matrix from, allocated on the CPU."""
    from megatron.core import parallel_state
    from megatron.core.utils import GlobalMemoryBuffer

    class CpuMemoryBuffer(GlobalMemoryBuffer):
        def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
            numel = 1
            for n in tensor_shape:
                numel *= n
            buf = self.buffer.get((name, dtype))
            if buf is None or buf.numel() < numel:
                buf = self.buffer[(name, dtype)] = torch.empty(numel, dtype=dtype)
            return buf[:numel].view(*tensor_shape)

    parallel_state._GLOBAL_MEMORY_BUFFER = CpuMemoryBuffer()


def _seed_model_parallel_cpu(seed: int) -> None:
    """Shim 1: megatron's RNG tracker (used by attention dropout in TP regions) on CPU RNG states."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mp_random

    class CpuRNGStatesTracker(mp_random.CudaRNGStatesTracker):
        def add(self, name, seed):
            if name in self.states_:
                raise ValueError(f"RNG state {name} already exists")
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                self.states_[name] = torch.get_rng_state()
            self.seeds_.add(seed)

        @contextlib.contextmanager
        def fork(self, name=mp_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    tracker = CpuRNGStatesTracker()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    # Same seed layout as model_parallel_cuda_manual_seed: default = seed, TP regions = seed+2718+rank.
    tracker.add(mp_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mp_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mp_random._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024)
    mp_random._CUDA_RNG_STATE_TRACKER = tracker
    mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def megatron_on_cpu(seed: int) -> None:
    """Shims 1-3 on a CPU-only torch, after every (re)initialisation of parallel_state: it builds a fresh
    CUDA memory buffer and RNG tracker each time."""
    apply_cpu_shims()
    _install_cpu_memory_buffer()
    _seed_model_parallel_cpu(seed)


def model_parallel_rng_states() -> dict[str, Any]:
    """megatron's model-parallel RNG tracker states (dropout inside TP regions): CUDA or, on CPU, shim 1's."""
    from megatron.core import tensor_parallel

    return tensor_parallel.get_cuda_rng_tracker().get_states()


def set_model_parallel_rng_states(states: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    tensor_parallel.get_cuda_rng_tracker().set_states(states)


# Keyword arguments that megatron's TransformerLayer hands its self-attention module beyond 0.16's, by the
# release that added them: 0.19 passes the module's ``name`` (a label for logging / checkpoint naming).
SELF_ATTENTION_NEW_KWARGS = ("name", "pp_layer_offset")


def self_attention_extra_kwargs(extra: dict[str, Any]) -> dict[str, Any]:
    """The extra keyword arguments PrismSelfAttention forwards to megatron's SelfAttention: the known newer
    ones. Anything else is an API change to look at here, not something to pass or drop blindly."""
    unknown = sorted(set(extra) - set(SELF_ATTENTION_NEW_KWARGS))
    if unknown:
        raise TypeError(
            f"PrismSelfAttention: megatron-core passed unknown argument(s) {unknown}; "
            "add them to pipeline/compat.py SELF_ATTENTION_NEW_KWARGS once checked"
        )
    return extra


_SINGLE_RANK_GROUPS: list | None = None


def single_rank_groups() -> list:
    """One process group per global rank holding only that rank (a "TP group" of size 1 for replicated
    attention). Collective: the first call must happen on every rank."""
    global _SINGLE_RANK_GROUPS
    if _SINGLE_RANK_GROUPS is None:
        world = torch.distributed.get_world_size()
        _SINGLE_RANK_GROUPS = [torch.distributed.new_group([r]) for r in range(world)]
    return _SINGLE_RANK_GROUPS


def replicated_attention_groups(pg_collection):
    """megatron's process groups for one attention module, with its TP group swapped for this rank's
    1-rank group: megatron then builds the QKV/O weights whole and runs no TP collectives for it."""
    import copy

    from megatron.core.process_groups_config import ProcessGroupCollection

    if pg_collection is None:
        pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
    pg_collection = copy.copy(pg_collection)
    pg_collection.tp = single_rank_groups()[torch.distributed.get_rank()]
    return pg_collection


def mark_replicated(parameters) -> None:
    """Mark a replicated module's weights as whole copies: megatron's parallel linears flag every weight as
    a TP shard, even in a 1-rank group, and DeepSpeed's grad norm would then count them once per TP rank."""
    for p in parameters:
        p.tensor_model_parallel = False


def output_layer_returns_hidden_states(model) -> None:
    """Make GPTModel's forward end at the final (normed) hidden states: its output layer returns its input
    instead of the [s, b, V/TP] logits, and the caller projects (pipeline.model.gpt: `lm_loss` chunk by
    chunk, `logits` whole), applying the TP copy itself.

    Relies on GPTModel's postprocess calling `output_layer(hidden, weight=..., runtime_gather_output=...)`
    and, with no labels, returning its output transposed to [b, s, ...] (0.16 and 0.19 do). The output layer
    features that would change that contract are off in Prism's configs; refused if ever on."""
    layer = model.output_layer
    unsupported = [
        name
        for name, on in [
            ("sequence_parallel", layer.sequence_parallel),
            ("gradient_accumulation_fusion", layer.gradient_accumulation_fusion),
            ("defer_embedding_wgrad_compute", layer.config.defer_embedding_wgrad_compute),
            ("mtp_num_layers", model.config.mtp_num_layers),
            ("use_mup", getattr(model.config, "use_mup", False)),  # 0.19 scales the logits then
        ]
        if on
    ]
    if unsupported:
        raise RuntimeError(f"pipeline/compat.py output_layer_returns_hidden_states: {unsupported} not supported")

    def hand_over(input_, weight=None, runtime_gather_output=None):
        return input_, None

    layer.forward = hand_over


def output_weight(model) -> torch.Tensor:
    """This TP rank's output projection [V/TP, d]: the word embeddings when tied (GPTModel then allocates
    no output weight), else the output layer's. ``model`` may be the DeepSpeed engine around the GPTModel."""
    gpt = getattr(model, "module", model)
    return gpt.embedding.word_embeddings.weight if gpt.share_embeddings_and_output_weights else gpt.output_layer.weight


# ======================================================================================================
# DeepSpeed: the mpu adapter, the CPU comm-op build skip, environment defaults.
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


def import_deepspeed():
    """Import DeepSpeed with our defaults: CPU accelerator without CUDA, a persistent JIT cache, and no
    shared-memory comm-op build on CPU (a ~40 s g++ JIT on first use; gloo does the collectives anyway)."""
    import importlib
    import sys
    from pathlib import Path

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


def load_zero_partitions_at_new_dp(engine: Any, load_dir: str, tag: str) -> None:
    """Elastic resume for ZeRO stages 1/2: restore the optimizer's fp32 master weights and moments from a
    checkpoint saved at another data-parallel size. bf16 at ZeRO-1 runs DeepSpeed's BF16_Optimizer, not its
    ZeRO optimizer: load_bf16_partitions_at_new_dp; any other optimizer is refused in one line.

    DeepSpeed 0.19's `load_checkpoint` refuses a DP change ("not currently supported") although its ZeRO-1/2
    optimizer can merge and re-split partitions (`_restore_elastic_*`), but only from "elastic" files, and
    its elastic save asserts a param-group "step" that torch's AdamW does not keep. So checkpoints stay in the
    default (rigid) format and are converted here: each saved partition's optimizer state loses its
    DP padding (only the last partition has any) and gets the step, then the optimizer's own merge runs.
    Call after `engine.load_checkpoint(..., load_optimizer_states=False)` loaded the module weights."""
    from deepspeed.checkpoint.constants import (
        BASE_OPTIMIZER_STATE,
        BASE_OPTIMIZER_STATE_STEP,
        GROUP_PADDINGS,
        OPTIMIZER_STATE_DICT,
    )
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from pipeline.config import ConfigError

    optimizer = engine.optimizer
    if isinstance(optimizer, BF16_Optimizer):
        return load_bf16_partitions_at_new_dp(engine, load_dir, tag)
    if not isinstance(optimizer, DeepSpeedZeroOptimizer):
        raise ConfigError(
            f"{os.path.join(load_dir, tag)}: saved at data-parallel size {engine.loaded_checkpoint_dp_world_size}, "
            f"this run has {engine.dp_world_size}, and its optimizer ({type(optimizer).__name__}) keeps a state that "
            f"is not re-split for another DP size (only ZeRO-1/2's and bf16 ZeRO-1's is); resume with data-parallel "
            f"size {engine.loaded_checkpoint_dp_world_size}"
        )
    names = engine._get_all_zero_checkpoint_names(load_dir, tag, engine.bfloat16_enabled())  # the saved DP size
    partitions = []
    for name in names:
        sd = torch.load(name, map_location="cpu", weights_only=False)[OPTIMIZER_STATE_DICT]
        base = sd[BASE_OPTIMIZER_STATE]
        if isinstance(base, dict):  # rigid: torch's state_dict, one padded flat partition per group
            groups = []
            for i, padding in enumerate(sd[GROUP_PADDINGS]):
                state = base["state"][i]
                groups.append(
                    {
                        k: v[: v.numel() - padding] if torch.is_tensor(v) and v.dim() == 1 and padding else v
                        for k, v in state.items()
                    }
                )
            sd[BASE_OPTIMIZER_STATE] = groups
            step = groups[0].get("step", 0)
            sd[BASE_OPTIMIZER_STATE_STEP] = float(step) if torch.is_tensor(step) else step
        partitions.append(sd)
    optimizer._load_global_state(partitions[0])
    optimizer._restore_elastic_base_optimizer_state(partitions)
    optimizer._restore_from_elastic_fp32_weights(partitions)
    optimizer._link_all_hp_params()


def remove_host_syncs(optimizer: Any) -> None:
    """Make the DeepSpeed optimizer wrapper's step read nothing on the host, where we know how (bf16 / fp32
    under ZeRO-1/2; the plain torch optimizer of ZeRO-0 reads nothing already). One sync remains for fp32
    ZeRO-1/2, see zero_clip_without_host_reads."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if isinstance(optimizer, BF16_Optimizer):  # bf16 + fp32 gradient accumulation, ZeRO-1
        sync_free_bf16_step(optimizer)
    elif isinstance(optimizer, DeepSpeedZeroOptimizer):  # ZeRO-2 bf16, ZeRO-1/2 fp32
        zero_clip_without_host_reads(optimizer)


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
            f"pipeline/compat.py sync_free_bf16_step: DeepSpeed's {type(optimizer).__name__} lacks {missing}; "
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
            f"pipeline/compat.py zero_clip_without_host_reads: DeepSpeed's {type(optimizer).__name__} lacks "
            f"{missing or ['unscale_and_clip_grads']}; re-mirror its unscale_and_clip_grads there"
        )
    import types

    optimizer.unscale_and_clip_grads = types.MethodType(_zero_unscale_and_clip_without_host_reads, optimizer)


def _zero_unscale_and_clip_without_host_reads(self: Any, grad_groups_flat: list, total_norm: Any) -> None:
    if self.clip_grad == 0.0 and self.loss_scale == 1.0:
        return

    combined_scale = self.loss_scale
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


def reshard_flat_partitions(saved: list[torch.Tensor], numel: int, partition_size: int, dp_rank: int) -> torch.Tensor:
    """Partition ``dp_rank`` (of ``partition_size`` elements) of a flat param group saved as equal partitions
    in DP-rank order at another DP size.

    DeepSpeed flattens a param group, pads it with zeros at the end to a multiple of its alignment (which
    grows with the DP size) and cuts it into equal partitions: the saved ones joined and cut to ``numel``
    (the params' elements) are the group at any DP size; the new padding is zeros again."""
    whole = torch.cat([t.reshape(-1) for t in saved])
    if whole.numel() < numel:
        raise ValueError(f"saved partitions hold {whole.numel()} elements, the group has {numel}")
    part = whole.new_zeros(partition_size)
    start = dp_rank * partition_size
    piece = whole[start : max(start, min(start + partition_size, numel))]
    part[: piece.numel()] = piece
    return part


def load_bf16_partitions_at_new_dp(engine: Any, load_dir: str, tag: str) -> None:
    """Elastic resume for DeepSpeed's BF16_Optimizer (bf16 weights, fp32 masters and gradient sums, ZeRO-1).

    Its own load reads only the file of its DP rank. Each param group is one flat tensor (the params in
    order, zero padding at the end) cut into DP equal partitions; a rank's file holds its partition of the
    fp32 master weights and torch AdamW's state over it (exp_avg, exp_avg_sq of the same length; step).
    Every saved partition is read, joined in DP-rank order, cut to the params and re-split at this DP size
    (reshard_flat_partitions); then DeepSpeed's per-param links (its fp32 views for each bf16 weight and its
    optimizer state, read by safe_get_full_fp32_param and universal checkpoints) are rebuilt over them.
    Call after `engine.load_checkpoint(..., load_optimizer_states=False)` loaded the module weights."""
    import deepspeed.comm as ds_dist
    from deepspeed.checkpoint.constants import (
        BASE_OPTIMIZER_STATE,
        CLIP_GRAD,
        GROUP_PADDINGS,
        OPTIMIZER_STATE_DICT,
        PARTITION_COUNT,
        SINGLE_PARTITION_OF_FP32_GROUPS,
    )

    from pipeline.config import ConfigError

    optimizer = engine.optimizer
    where = os.path.join(load_dir, tag)
    names = engine._get_all_zero_checkpoint_names(load_dir, tag, True)  # one per saved DP rank, in order
    missing = [os.path.basename(n) for n in names if not os.path.isfile(n)]
    if missing:
        raise ConfigError(
            f"{where}: {missing[0]} is missing, the bf16 optimizer state of a saved DP rank (was the checkpoint "
            f"written with another train.precision?); resume with data-parallel size "
            f"{engine.loaded_checkpoint_dp_world_size} and the checkpoint's precision"
        )
    saved = [torch.load(n, map_location="cpu", weights_only=False)[OPTIMIZER_STATE_DICT] for n in names]
    if any(sd[PARTITION_COUNT] != [len(saved)] * len(optimizer.bf16_groups) for sd in saved):
        raise ConfigError(
            f"{where}: its bf16 optimizer files do not form {len(saved)} partitions of "
            f"{len(optimizer.bf16_groups)} param groups; resume with data-parallel size {len(saved)}"
        )
    torch_states = [sd[BASE_OPTIMIZER_STATE] for sd in saved]  # torch AdamW's state_dict over the partitions
    loaded_state: dict[int, dict[str, Any]] = {}
    for i, (params, master) in enumerate(zip(optimizer.bf16_groups, optimizer.fp32_groups_flat_partition)):
        group = optimizer.real_dp_process_group[i]
        dp_rank = ds_dist.get_rank(group=group)
        numel = sum(p.numel() for p in params)
        saved_numel = sum(sd[SINGLE_PARTITION_OF_FP32_GROUPS][i].numel() - sd[GROUP_PADDINGS][i] for sd in saved)
        if saved_numel != numel:
            raise ConfigError(
                f"{where}: param group {i} holds {saved_numel} elements in the checkpoint, {numel} in this model; "
                f"resume with the model it was saved with"
            )

        layout = (numel, master.numel(), dp_rank)  # the params' elements, this rank's partition: size, index
        with torch.no_grad():
            master.copy_(reshard_flat_partitions([sd[SINGLE_PARTITION_OF_FP32_GROUPS][i] for sd in saved], *layout))
        # torch's state_dict numbers the params across groups; here each group has one (its flat partition)
        index = torch_states[0]["param_groups"][i]["params"][0]
        per_rank = [ts["state"].get(index, {}) for ts in torch_states]
        saved_partition_shape = saved[0][SINGLE_PARTITION_OF_FP32_GROUPS][i].shape
        loaded_state[index] = {
            key: reshard_flat_partitions([state[key] for state in per_rank], *layout)
            if torch.is_tensor(value) and value.shape == saved_partition_shape  # exp_avg, exp_avg_sq; not step
            else value
            for key, value in per_rank[0].items()
        }
    optimizer.optimizer.load_state_dict({"state": loaded_state, "param_groups": torch_states[0]["param_groups"]})
    optimizer.clip_grad = saved[0].get(CLIP_GRAD, optimizer.clip_grad)
    # The bf16 weights came from the module file, written from these masters rounded: they match already.
    # DeepSpeed's per-param views into the masters and the moments are rebuilt over the loaded tensors.
    optimizer._link_all_hp_params()
    optimizer._hp_optimizer_states_linked = False
    if loaded_state and all(loaded_state.values()):  # a checkpoint saved before any step has no moments yet
        optimizer._lazy_init_hp_params_optimizer_state()

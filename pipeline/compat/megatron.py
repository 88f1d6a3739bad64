"""megatron-core quirks: CPU shims, the RNG tracker, and what differs between the releases Prism runs on.

Megatron-core assumes CUDA in a few spots (listed below). On a CPU-only torch we swap in small
CPU equivalents, and only then: with CUDA present nothing here patches anything.

  1. `model_parallel_cuda_manual_seed` / the RNG tracker use `torch.cuda` RNG states -> a CPU tracker;
  2. `get_global_memory_buffer()` allocates on the current CUDA device -> a CPU buffer;
  3. the default causal mask in fused_softmax is built on "cuda" -> built on the CPU;
  4. `RotaryEmbedding.get_emb` moves `inv_freq` to CUDA -> not used: pipeline.model builds its own
     rotary table per head dim (one per d_h, the Prism layers differ), on the activations' device.
And one quirk of torch's CPU build itself, applied with them: oneMKL picks each VML kernel on its first call,
and first calls racing on several threads can compute with a low-accuracy kernel (resolve_mkl_vml_kernels).

Checkpoints read and restore the RNG tracker's states through here too (model_parallel_rng_states).

Versions: 0.16.x (Python 3.11, `make test`) and 0.19.x (Python 3.12, `make test-py312`, the tests marked
megatron_compat) are tested; every difference between them is handled in this module and nowhere else
(self_attention_extra_kwargs: 0.19's name=; output_layer_returns_hidden_states: 0.19's use_mup). GPTModel's
forward ends at the final hidden states (output_layer_returns_hidden_states).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

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
    resolve_mkl_vml_kernels()
    _CPU_SHIMS_APPLIED = True


# Float functions torch's CPU kernels hand to MKL's VML (aten/src/ATen/cpu/vml.h); a few more are harmless.
VML_FUNCTIONS = (
    "acos", "asin", "atan", "cos", "sin", "tan", "tanh", "erf", "erfc", "erfinv", "exp", "expm1", "log", "log10",
    "log1p", "log2", "sqrt", "rsqrt", "sigmoid", "trunc",
)  # fmt: skip


def resolve_mkl_vml_kernels() -> None:
    """Call each VML function once on one element, so oneMKL picks its kernels before any op runs them on
    several threads at once.

    oneMKL 2024.2 (torch 2.13's CPU wheel links Build 20240605) picks a VML function's kernel on its first call,
    and first calls racing on several threads can run one thread's chunk with its low-accuracy kernel although
    torch asks for high accuracy (pytorch/pytorch#188792). The likely cause of tests/unit/test_model.py's
    attention check failing about one fresh process in ten: only the query, whose RoPE is a process's first
    cos/sin, differed (by ~4e-4, as that kernel's cos error of 1.5e-4 times the query would). One element runs
    on one thread; both precisions, as VML picks per precision."""
    for dtype in (torch.float32, torch.float64):
        one = torch.full((1,), 0.5, dtype=dtype)
        for name in VML_FUNCTIONS:
            getattr(torch, name)(one)


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
            "add them to pipeline/compat/megatron.py SELF_ATTENTION_NEW_KWARGS once checked"
        )
    return extra


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
        raise RuntimeError(
            f"pipeline/compat/megatron.py output_layer_returns_hidden_states: {unsupported} not supported"
        )

    def hand_over(input_, weight=None, runtime_gather_output=None):
        return input_, None

    layer.forward = hand_over


def output_weight(model) -> torch.Tensor:
    """This TP rank's output projection [V/TP, d]: the word embeddings when tied (GPTModel then allocates
    no output weight), else the output layer's. ``model`` may be the DeepSpeed engine around the GPTModel."""
    gpt = getattr(model, "module", model)
    return gpt.embedding.word_embeddings.weight if gpt.share_embeddings_and_output_weights else gpt.output_layer.weight

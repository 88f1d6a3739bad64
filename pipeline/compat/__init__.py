"""Library quirks and version differences, in two rooms: nothing else in Prism patches library internals.

- pipeline.compat.megatron: megatron-core's CUDA-only spots on a CPU torch, its RNG tracker states, the
  0.16 / 0.19 API differences, GPTModel's forward ending at the hidden states;
- pipeline.compat.deepspeed: the adapters deepspeed.initialize needs, and the private DeepSpeed code Prism
  copies (the sync-free optimizer step, checkpoint files staged for a background write) behind an exact version check;
- pipeline.compat.optim: the fused torch AdamW's found_inf, which skips a step on the device.
- pipeline.compat.torch_distributed: process-group timeouts changed after init, failed collectives recognised.

Callers write ``from pipeline import compat; compat.X``: the names below are that interface.
"""

from pipeline.compat.deepspeed import (
    DEEPSPEED_MIRRORED,
    MegatronMpu,
    StagingCheckpointEngine,
    import_deepspeed,
    pre_step_grad_norm,
    remove_host_syncs,
    stage_checkpoint_writes,
    sync_free_bf16_step,
    zero_clip_without_host_reads,
)
from pipeline.compat.megatron import (
    SELF_ATTENTION_NEW_KWARGS,
    apply_cpu_shims,
    cuda_available,
    megatron_on_cpu,
    model_parallel_rng_states,
    output_layer_returns_hidden_states,
    output_weight,
    self_attention_extra_kwargs,
    set_model_parallel_rng_states,
    use_cpu_device,
)
from pipeline.compat.optim import SkipStepAdamW
from pipeline.compat.torch_distributed import collective_failed, set_collective_timeout

__all__ = [
    "DEEPSPEED_MIRRORED",
    "SELF_ATTENTION_NEW_KWARGS",
    "MegatronMpu",
    "StagingCheckpointEngine",
    "SkipStepAdamW",
    "apply_cpu_shims",
    "collective_failed",
    "cuda_available",
    "import_deepspeed",
    "megatron_on_cpu",
    "model_parallel_rng_states",
    "output_layer_returns_hidden_states",
    "output_weight",
    "pre_step_grad_norm",
    "remove_host_syncs",
    "self_attention_extra_kwargs",
    "set_collective_timeout",
    "set_model_parallel_rng_states",
    "stage_checkpoint_writes",
    "sync_free_bf16_step",
    "use_cpu_device",
    "zero_clip_without_host_reads",
]

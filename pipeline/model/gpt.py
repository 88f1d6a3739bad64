"""Config -> megatron-core GPTModel with per-layer head counts; loss and logits (sizes: pipeline.model_size).

The whole Prism change is `PrismTransformerConfig.get_config_for_layer`: megatron's TransformerBlock asks it
for every layer's config when `heterogeneous_block_specs` is set, and layer l gets h_l heads of
d_model / h_l dims, read from the config's `layer_plan` (made once when the config loads). Q, K, V and O
stay d x d, so parameters and (non-attention) FLOPs do not move.
The uniform arm is the same code with a constant schedule.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig

from pipeline import model_size, schedule
from pipeline.config import Config, ConfigError
from pipeline.distributed import tp_all_gather, train_device
from pipeline.model.fusions import compile_model, megatron_fusion_flags
from pipeline.model.replication import single_rank_groups

log = logging.getLogger(__name__)


@dataclasses.dataclass
class PrismTransformerConfig(TransformerConfig):
    """TransformerConfig whose layers each get their own head count (and head dim)."""

    layer_plan: tuple[schedule.LayerPlan, ...] = ()  # Config.layer_plan; the attention module reads it too
    rope_base: float = 10000.0  # one rotary table per distinct head dim (attention.rope_table)

    def __post_init__(self):
        super().__post_init__()
        if len(self.layer_plan) != self.num_layers:
            raise ValueError(f"layer_plan has {len(self.layer_plan)} entries for {self.num_layers} layers")
        self.heterogeneous_block_specs = True

    def get_config_for_layer(self, layer_number: int) -> TransformerConfig:
        layer = self.layer_plan[layer_number - 1]  # layer_number is 1-based
        return dataclasses.replace(
            self,
            num_attention_heads=layer.heads,
            num_query_groups=layer.heads,
            kv_channels=layer.head_dim,
            # only the attention is replicated (PrismSelfAttention); megatron checks heads % tp
            tensor_model_parallel_size=1 if layer.replicated else self.tensor_model_parallel_size,
        )


def replicated_layers(cfg: Config) -> list[int]:
    """1-based layers whose attention runs replicated on every TP rank (from cfg.layer_plan)."""
    return [layer.number for layer in cfg.layer_plan if layer.replicated]


def replication_overhead(cfg: Config) -> int:
    """Extra training FLOPs per token on EACH TP rank caused by replicated attention: such a layer's QKV/O
    projections and attention run in full on every rank instead of 1/TP of them."""
    m, tp = cfg.model, cfg.parallel.tp
    extra = 0
    for layer in cfg.layer_plan:
        if layer.replicated:
            f = model_size.layer_flops(m.d_model, m.ffn_hidden_size, layer.heads, m.seq_len)
            extra += 3 * (f["projections"] + f["attention"]) * (tp - 1) // tp
    return extra


def use_cuda(cfg: Config) -> bool:
    return train_device(cfg) == "cuda"


def transformer_config(cfg: Config, *, meta: bool = False) -> PrismTransformerConfig:
    m, on_cuda = cfg.model, use_cuda(cfg)
    bf16 = cfg.train.precision == "bf16"
    return PrismTransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.d_model,
        ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.h_base,  # model-level values = the baseline; layers override
        num_query_groups=m.h_base,
        kv_channels=m.d_model // m.h_base,
        layer_plan=cfg.layer_plan,
        tensor_model_parallel_size=cfg.parallel.tp,
        normalization="RMSNorm" if m.norm == "rmsnorm" else "LayerNorm",
        layernorm_epsilon=m.norm_eps,
        add_bias_linear=m.bias,
        gated_linear_unit=m.activation == "swiglu",
        activation_func=F.silu if m.activation == "swiglu" else F.gelu,
        hidden_dropout=m.dropout,
        attention_dropout=m.dropout,
        init_method_std=m.init_std,
        rope_base=m.rope_base,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_cpu_initialization=not on_cuda or meta,
        perform_initialization=not meta,
        **megatron_fusion_flags(cfg),
    )


def _te_import_error() -> str | None:
    """Why TransformerEngine's PyTorch modules cannot be used here (None when they import). A TE built
    against another torch can fail with other errors than ImportError, so any exception counts."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")
    return None


def check_spec(cfg: Config) -> str:
    """The layer spec ``model.spec`` names, refused in one line where it cannot be built (before any model)."""
    if cfg.model.spec == "transformer_engine":
        if not use_cuda(cfg):
            raise ConfigError(
                f"{cfg.source}: model.spec: transformer_engine needs a CUDA device (train.device resolves to cpu); "
                f"use model.spec=local"
            )
        why = _te_import_error()
        if why is not None:
            raise ConfigError(
                f"{cfg.source}: model.spec: transformer_engine does not import here ({why}); install "
                f"TransformerEngine for this torch or use model.spec=local"
            )
    return cfg.model.spec


def layer_spec(cfg: Config, *, allow_te: bool = True):
    """megatron's GPT layer spec as ``model.spec`` says (local unless transformer_engine is asked for; an
    installed TE alone changes nothing) with our per-d_h-RoPE self-attention and the configured core
    attention. allow_te=False builds the local spec (meta-device parameter counting)."""
    from megatron.core.models.gpt import gpt_layer_specs

    from pipeline.model.attention import PrismSelfAttention, SDPAttention

    if allow_te and check_spec(cfg) == "transformer_engine":
        spec, name = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(), "transformer_engine"
    else:
        norm = "RMSNorm" if cfg.model.norm == "rmsnorm" else "LayerNorm"
        spec, name = gpt_layer_specs.get_gpt_layer_local_spec(normalization=norm), "local"
    attn = spec.submodules.self_attention
    attn.module = PrismSelfAttention
    if cfg.model.attention_backend != "megatron":  # sdpa, or a pinned SDPA kernel
        attn.submodules.core_attention = SDPAttention
    log.info("model: %s layer spec, core attention %s", name, attn.submodules.core_attention.__name__)
    return spec


def check_tp_groups(cfg: Config) -> None:
    """Refuse, before any weight exists, a TP size the initialised process groups do not have (the
    schedule itself was validated when the config loaded)."""
    from megatron.core import parallel_state

    tp = cfg.parallel.tp
    if parallel_state.model_parallel_is_initialized():
        world_tp = parallel_state.get_tensor_model_parallel_world_size()
        if world_tp != tp:
            raise ConfigError(
                f"{cfg.source}: parallel.tp={tp} but model parallel was initialised with TP={world_tp}; "
                f"call pipeline.distributed.init_model_parallel({tp}, seed) first"
            )


def build_model(cfg: Config, *, meta: bool = False):
    """megatron-core GPTModel for ``cfg`` (call pipeline.distributed.init_model_parallel first).

    meta=True builds on the meta device without allocating or initialising weights (model report)."""
    from megatron.core.models.gpt import GPTModel

    from pipeline import compat

    check_tp_groups(cfg)
    compat.apply_cpu_shims()
    if replicated_layers(cfg):
        single_rank_groups()  # collective: every rank creates every 1-rank group, in order
        share = replication_overhead(cfg) / (model_size.flops_per_token(cfg) / cfg.parallel.tp)
        log.warning(
            "model: layers %s have head counts not divisible by TP=%d and run their attention replicated "
            "on every TP rank: +%s training FLOPs per token per rank (+%.1f%% of a rank's share); "
            "the two arms are no longer compute-neutral",
            replicated_layers(cfg),
            cfg.parallel.tp,
            f"{replication_overhead(cfg):,}",
            100 * share,
        )
    config = transformer_config(cfg, meta=meta)
    device = torch.device("meta") if meta else contextlib.nullcontext()
    with device:
        model = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec(cfg, allow_te=not meta),  # TE modules cannot live on meta
            vocab_size=model_size.padded_vocab(cfg),
            max_sequence_length=cfg.model.seq_len,
            share_embeddings_and_output_weights=cfg.model.tie_embeddings,
            position_embedding_type="none",  # RoPE is applied per layer (PrismSelfAttention)
        )
    model.prism_vocab_size = cfg.model.vocab_size  # logits() cuts the padding off
    compat.output_layer_returns_hidden_states(model)  # lm_loss and logits() project: see pipeline.model.loss
    if not meta:
        pin_sdpa_kernel(cfg, model)
    if config.bf16 and not meta:
        model.bfloat16()  # norms are created in fp32 otherwise
    if use_cuda(cfg) and not meta:
        model.cuda(torch.cuda.current_device())
    if not meta:
        compile_model(cfg, model)
    return model


def pin_sdpa_kernel(cfg: Config, model) -> None:
    """Log the SDPA kernel per head dim (refusing a pinned one that cannot run here) and pin it in every layer."""
    from pipeline.model import sdpa_backend

    sdpa_backend.check_and_log(cfg, train_device(cfg))
    for layer in model.decoder.layers:
        layer.self_attention.core_attention.sdpa_backend = sdpa_backend.pinned_backend(cfg)


def _final_hidden_states(model, inputs: torch.Tensor) -> torch.Tensor:
    """[b, s, d]: where the model ends (pipeline.compat.output_layer_returns_hidden_states), passed through
    megatron's TP copy, whose backward sums the gradients of the vocab slices each TP rank projects to.
    Applied here, on the contiguous [b, s, d]: megatron's all-reduce leaves a non-contiguous gradient (that
    of the [s, b, d] -> [b, s, d] transpose) unreduced."""
    from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

    device = next(model.parameters()).device
    return copy_to_tensor_model_parallel_region(model(inputs.to(device, non_blocking=True), None, None))


def _forward_local_logits(model, inputs: torch.Tensor) -> torch.Tensor:
    """[b, s, padded_vocab / TP]: this TP rank's slice of the logits."""
    from pipeline.compat import output_weight

    return F.linear(_final_hidden_states(model, inputs), output_weight(model))


def lm_loss(model, tokens: torch.Tensor, z_loss: float = 0.0, token_losses: torch.Tensor | None = None) -> torch.Tensor:
    """Mean next-token cross-entropy (fp32) of int64 ``tokens`` [b, seq_len + 1]; vocab-parallel under TP.
    ``z_loss`` > 0 (train.z_loss) adds that coefficient times the mean squared log-sum-exp (PaLM's z-loss).

    The output projection and the loss run a chunk of tokens at a time (pipeline.model.loss): neither the
    [b, s, V] logits nor an fp32 copy of them is ever made. ``token_losses`` (fp32, [b * seq_len]) receives each
    token's cross-entropy, row by row: validation's per-sequence losses, beside an unchanged mean."""
    from pipeline.compat import output_weight
    from pipeline.model.loss import linear_cross_entropy

    device = next(model.parameters()).device
    targets = tokens[:, 1:].to(device, non_blocking=True)
    hidden = _final_hidden_states(model, tokens[:, :-1])
    return linear_cross_entropy(hidden, output_weight(model), targets, z_loss, token_losses)


def logits(model, inputs: torch.Tensor) -> torch.Tensor:
    """[b, s, vocab] logits, gathered over TP ranks, padding columns removed (for eval: the TP gather
    carries no gradient)."""
    out = tp_all_gather(_forward_local_logits(model, inputs), dim=-1)
    return out[..., : _true_vocab(model)]


def _true_vocab(model) -> int:
    return getattr(model, "prism_vocab_size", model.vocab_size)

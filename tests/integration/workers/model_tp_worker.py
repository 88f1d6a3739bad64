"""torchrun worker for tests/integration/test_model_tp.py: the same weights at TP=1 and TP=2 give the same output.

Run with 2 processes (gloo): builds the TP=1 model on every rank, records logits, loss and grads, then
re-initialises megatron with TP=2, loads the TP=1 weights split into shards and records the same.
Rank 0 saves both to argv[1].
"""

import sys

import torch

from pipeline import config, distributed
from pipeline.model import build_model, capture_attention, lm_loss, logits
from pipeline.model import loss as loss_module
from pipeline.model.gpt import _forward_local_logits

loss_module.CHUNK_ELEMENTS["cpu"] = 8 * 8192  # the chunked loss walks several chunks of tokens here

CONFIG = "configs/tiny_prism.yaml"
SHORT = ["model.seq_len=64"]
SCENARIOS = {
    # the tiny preset itself: its 3-head layers cannot split over 2 ranks, so they run replicated (opt-in)
    "replicated": SHORT + ["parallel.replicate_indivisible_layers=true"],
    # the tiny shape with a Prism schedule TP=2 splits everywhere
    "split": SHORT + ["schedule.heads=6x2,12x6"],
}


def shard(full: dict, model) -> dict:
    """Slice TP=1 tensors into this rank's TP shards, using megatron's partition attributes."""
    from megatron.core import parallel_state

    rank, tp = (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_world_size(),
    )
    params = dict(model.named_parameters())
    out = {}
    for name, tensor in full.items():
        p = params.get(name)
        if p is None or not getattr(p, "tensor_model_parallel", False):
            out[name] = tensor
        elif name.endswith("mlp.linear_fc1.weight"):  # SwiGLU: [gate; up], each split separately
            gate, up = tensor.chunk(2, dim=0)
            out[name] = torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])
        else:
            out[name] = tensor.chunk(tp, dim=p.partition_dim)[rank]
    return out


def run(model, tokens):
    model.eval()
    loss = lm_loss(model, tokens)
    loss.backward()
    with torch.no_grad(), capture_attention(model) as maps:
        out = logits(model, tokens[:, :-1])
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return out, loss.detach(), grads, maps


def megatron_loss(model, tokens):
    """megatron's fp32 vocab-parallel cross-entropy on the same model: what lm_loss replaced."""
    from megatron.core import tensor_parallel

    with torch.no_grad():
        local = _forward_local_logits(model, tokens[:, :-1])
        return tensor_parallel.vocab_parallel_cross_entropy(local.float(), tokens[:, 1:]).mean()


def compare(overrides: list[str]) -> dict:
    cfg1 = config.load(CONFIG, overrides + ["parallel.tp=1"])
    distributed.init_model_parallel(1, cfg1.run.seed)
    ref = build_model(cfg1)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg1.model.vocab_size, (2, cfg1.model.seq_len + 1), generator=gen)
    ref_logits, ref_loss, ref_grads, ref_maps = run(ref, tokens)
    full = {k: v.clone() if torch.is_tensor(v) else v for k, v in ref.state_dict().items()}

    cfg2 = config.load(CONFIG, overrides + ["parallel.tp=2"])
    distributed.init_model_parallel(2, cfg2.run.seed)
    model = build_model(cfg2)
    model.load_state_dict(shard(full, model))
    tp_logits, tp_loss, tp_grads, tp_maps = run(model, tokens)
    layers = [layer.self_attention for layer in model.decoder.layers]
    return {
        "ref_logits": ref_logits,
        "ref_loss": ref_loss,
        "tp_logits": tp_logits,
        "tp_loss": tp_loss,
        "tp_megatron_loss": megatron_loss(model, tokens),
        # shard the reference grads the same way, so each rank compares like with like
        "ref_grads": shard(ref_grads, model),
        "tp_grads": tp_grads,
        "ref_maps": ref_maps,
        "tp_maps": tp_maps,  # gathered over TP: all h_l heads of every layer
        "tp_heads": [a.num_attention_heads_per_partition for a in layers],
        "replicated": [a.plan.replicated for a in layers],  # what the module (and capture) read
        "planned": [p.replicated for p in cfg2.layer_plan],  # what the config decided
        "tp_group_size": [a.pg_collection.tp.size() for a in layers],
        "sharded": [a.linear_qkv.weight.tensor_model_parallel for a in layers],
    }


def main(out_path: str) -> None:
    results = {name: compare(overrides) for name, overrides in SCENARIOS.items()}
    if torch.distributed.get_rank() == 0:
        torch.save(results, out_path)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])

"""Cross-entropy of the output projection a chunk of tokens at a time: the [tokens, V] logits never exist.

megatron's labels path projects the final hidden states to [s, b, V/TP] logits in the model's dtype, and
`vocab_parallel_cross_entropy(logits.float())` adds an fp32 copy of them and keeps an fp32 softmax for
backward: at 124M, micro-batch 16, 0.8 GB of bf16 logits plus 3.3 GB per fp32 copy. Here the model hands
over its final hidden states (pipeline.compat.output_layer_returns_hidden_states) and this loss projects
one chunk of tokens, takes its log-sum-exp and target logit in fp32 and, when a gradient is wanted, forms
that chunk's (softmax - onehot) / tokens at once and multiplies it into the hidden-state and weight
gradients. The mean loss is a scalar, so backward only scales those gradients: the output projection costs
the same three matmuls as unchunked, and the extra memory is one chunk (CHUNK_ELEMENTS) plus an fp32 sum
of the weight gradient.

Under TP each rank holds a vocab slice of the weight: each chunk's log-sum-exp and target logit are
combined over the TP group (three all-reduces of [chunk] vectors), and the sum over the slices of the
hidden-state gradient is the backward of the TP copy applied before it (pipeline.model.gpt).

z-loss (train.z_loss = c > 0, PaLM's auxiliary term): c * mean(lse^2) is added to the loss, with lse the
log-sum-exp over the whole vocab; its gradient c * 2 * lse * softmax / tokens joins the chunk's softmax term.
With c = 0 none of it runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Logits per chunk (fp32 elements), by device. Each chunk adds its weight gradient into the fp32 sum: a
# read and write of ~12 bytes per output weight. On a GPU (~200 flops per byte of memory bandwidth) that
# stays under ~10 % of the projection's matmul time from ~4k tokens per chunk; on a CPU memory is short.
CHUNK_ELEMENTS = {"cuda": 1 << 28, "cpu": 1 << 24}  # 5336 / 333 tokens of a 50304 vocab
WEIGHT_GRAD_BLOCK = 1 << 22  # a chunk's weight gradient is added in blocks of vocab rows of this many elements


def _tp_group():
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None, 1, 0
    group = parallel_state.get_tensor_model_parallel_group()
    return (
        group,
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_rank(),
    )


def _chunks(tokens: int, vocab: int, device: torch.device):
    step = max(1, CHUNK_ELEMENTS.get(device.type, CHUNK_ELEMENTS["cpu"]) // max(1, vocab))
    for start in range(0, tokens, step):
        yield start, min(tokens, start + step)


def _chunk_lse_and_target(logits: torch.Tensor, local, in_slice, group, tp: int):
    """fp32 log-sum-exp over the whole vocab and the target's logit, per token of one chunk."""
    lse = torch.logsumexp(logits, dim=-1)
    target = torch.where(in_slice, logits.gather(1, local[:, None]).squeeze(1), torch.zeros_like(lse))
    if tp > 1:
        import torch.distributed as dist

        top = lse.clone()  # max-shifted sum of each slice's exps
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        total = torch.exp(lse - top)
        dist.all_reduce(total, group=group)
        lse = top + torch.log(total)
        dist.all_reduce(target, group=group)  # exactly one rank holds each target
    return lse, target


class LinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy (fp32 scalar) of hidden [N, d] @ weight[V_local, d].T against int64 targets [N]."""

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        with_grads: bool,
        z_loss: float = 0.0,
        token_losses: torch.Tensor | None = None,
    ):
        group, tp, rank = _tp_group()
        n, vocab = hidden.shape[0], weight.shape[0]
        local = targets - rank * vocab  # this rank's vocab slice: [rank * vocab, (rank + 1) * vocab)
        in_slice = (local >= 0) & (local < vocab)
        local = torch.where(in_slice, local, torch.zeros_like(local))
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        if with_grads:
            grad_hidden = torch.empty_like(hidden)
            # fp32 sum of the chunks' weight gradients: a bf16 running sum would round once per chunk
            grad_weight = torch.zeros_like(weight, dtype=torch.float32)
            rows = max(1, WEIGHT_GRAD_BLOCK // weight.shape[1])  # added in blocks: no [V, d] temporary per chunk
        for a, b in _chunks(n, vocab, hidden.device):
            logits = F.linear(hidden[a:b], weight).float()
            lse, target = _chunk_lse_and_target(logits, local[a:b], in_slice[a:b], group, tp)
            total += (lse - target).sum()
            if token_losses is not None:  # each token's loss beside the mean, which it leaves unchanged
                token_losses[a:b] = lse - target
            if z_loss:
                total += z_loss * lse.square().sum()
            if with_grads:
                grad = torch.exp(logits.sub_(lse[:, None]))  # softmax, in place of the chunk's logits
                if z_loss:
                    grad.mul_((1.0 + 2.0 * z_loss * lse)[:, None])  # d(c lse^2)/d logit = 2 c lse softmax
                grad.scatter_add_(1, local[a:b, None], -in_slice[a:b, None].float())  # - onehot
                grad = grad.div_(n).to(hidden.dtype)  # d mean / d logit, in the dtype megatron's backward has
                grad_hidden[a:b] = grad @ weight
                for v in range(0, vocab, rows):
                    grad_weight[v : v + rows].add_(grad[:, v : v + rows].t() @ hidden[a:b])
        if with_grads:  # backward only scales them (DeepSpeed's 1 / grad_accum: a power of two in the presets)
            ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype))
        return total / n

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        grads = grad_hidden * grad_loss.to(grad_hidden.dtype), grad_weight * grad_loss.to(grad_weight.dtype)
        return *grads, None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    z_loss: float = 0.0,
    token_losses: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean next-token cross-entropy (fp32) of hidden states [..., d] projected by this TP rank's output
    weight [V/TP, d], against targets [...]; vocab-parallel under TP. ``z_loss`` > 0 adds z_loss * mean(lse^2).
    ``token_losses`` (fp32, one per target, flattened) receives each token's cross-entropy."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    with_grads = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return LinearCrossEntropy.apply(flat, weight, targets.reshape(-1), with_grads, z_loss, token_losses)

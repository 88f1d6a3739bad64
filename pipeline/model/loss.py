"""Chunked vocab-parallel cross-entropy that never holds fp32 logits for the whole batch.

megatron's `vocab_parallel_cross_entropy(logits.float(), ...)` makes an fp32 copy of the [b, s, V/TP] logits
and keeps an fp32 softmax of the same size for backward: at 124M, micro-batch 16, that is 3.3 GB per copy.
Here the logits stay in their own dtype; forward walks them a chunk of tokens at a time in fp32 and keeps
only the per-token log-sum-exp; backward recomputes each chunk's softmax from the logits and the saved
log-sum-exp and writes the gradient chunk by chunk. Peak extra memory: one fp32 chunk (CHUNK_ELEMENTS).

Under TP each rank holds a vocab slice: the per-token local log-sum-exps and target logits are combined
over the TP group with three all-reduces of [tokens] fp32 vectors (not per chunk), and backward needs no
communication (d loss / d logit = softmax - onehot, both local to the slice).
"""

from __future__ import annotations

import types

import torch

CHUNK_ELEMENTS = 1 << 24  # fp32 elements per chunk: 64 MB (333 tokens of a 50304 vocab)


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


def _chunks(tokens: int, vocab: int):
    step = max(1, CHUNK_ELEMENTS // max(1, vocab))
    for start in range(0, tokens, step):
        yield start, min(tokens, start + step)


class ChunkedVocabParallelCE(torch.autograd.Function):
    """Per-token loss [N] (fp32) of logits [N, V_local] (any float dtype) against int64 targets [N]."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, grad_in_logits: bool = False) -> torch.Tensor:
        group, tp, rank = _tp_group()
        n, vocab = logits.shape
        first = rank * vocab  # this rank's vocab slice: [first, first + vocab)
        local = targets - first
        in_slice = (local >= 0) & (local < vocab)
        local = torch.where(in_slice, local, torch.zeros_like(local))
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        target_logit = torch.empty(n, dtype=torch.float32, device=logits.device)
        for a, b in _chunks(n, vocab):
            chunk = logits[a:b].float()
            lse[a:b] = torch.logsumexp(chunk, dim=-1)
            target_logit[a:b] = chunk.gather(1, local[a:b, None]).squeeze(1)
        target_logit = torch.where(in_slice, target_logit, torch.zeros_like(target_logit))
        if tp > 1:
            import torch.distributed as dist

            # log-sum-exp over the whole vocab from each rank's slice: max-shifted sum of exps
            top = lse.clone()
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
            total = torch.exp(lse - top)
            dist.all_reduce(total, group=group)
            lse = top + torch.log(total)
            dist.all_reduce(target_logit, group=group)  # exactly one rank holds each target
        ctx.grad_in_logits = grad_in_logits
        ctx.save_for_backward(logits, lse, local, in_slice)
        return lse - target_logit

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        logits, lse, local, in_slice = ctx.saved_tensors
        n, vocab = logits.shape
        # The logits' own buffer can take the gradient when nothing else reads them after the loss (the
        # model's internal logits): then backward allocates nothing of [N, V] size.
        grad = logits if ctx.grad_in_logits else torch.empty_like(logits)
        grad_loss = grad_loss.float()
        for a, b in _chunks(n, vocab):
            probs = torch.exp(logits[a:b].float() - lse[a:b, None])
            probs.scatter_add_(1, local[a:b, None], -in_slice[a:b, None].float())  # softmax - onehot
            grad[a:b] = probs * grad_loss[a:b, None]
        return grad, None, None


def sequence_first_loss(model, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """GPTModel.compute_language_model_loss replacement: per-token loss [b, s] from megatron's [s, b, V/TP]
    logits and [b, s] labels, without the [s, b, V] -> [b, s, V] copy GPTModel makes when it returns logits."""
    s, b = logits.shape[0], logits.shape[1]
    flat = logits.reshape(s * b, logits.shape[-1])
    # GPTModel never returns these logits on the labels path: backward may overwrite them with their gradient
    per_token = ChunkedVocabParallelCE.apply(flat, labels.t().reshape(-1), True)
    return per_token.view(s, b).t()


def use_chunked_loss(model) -> None:
    """Make ``model(inputs, None, None, labels=targets)`` use the chunked loss (megatron's own loss hook)."""
    model.compute_language_model_loss = types.MethodType(sequence_first_loss, model)


def chunked_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (fp32) of this TP rank's logits [..., V/TP] against targets [...]."""
    flat = logits.reshape(-1, logits.shape[-1])
    return ChunkedVocabParallelCE.apply(flat, targets.reshape(-1)).mean()

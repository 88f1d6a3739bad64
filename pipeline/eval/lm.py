"""Our GPTModel as an lm-eval language model: batched log-likelihoods of continuations.

lm-eval's TemplateLM does the text side (context/continuation split: the context's trailing spaces move
to the continuation, the pair is encoded as a whole and split at the context's token count, so the
boundary token is the one the tokenizer really produces). This class does the token side: left-truncate
to the model's context, batch by length, score the continuation positions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

LogitsFn = Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]


class PrismLM(TemplateLM):
    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        eos_id: int,
        seq_len: int,
        batch_size: int = 16,
        logits_fn: LogitsFn | None = None,
        batch_tokens: int | None = None,
    ):
        """batch_size: rows per forward pass; with batch_tokens, as many rows as fit in that many tokens at the
        batch's width instead (short requests, as most are, then fill a forward pass as a training batch does)."""
        super().__init__()
        if logits_fn is None:
            from pipeline.model import logits as logits_fn
        self.model = model.eval()
        self.tokenizer = tokenizer  # a `tokenizers.Tokenizer`
        self.eos_id = eos_id
        self.max_length = seq_len
        self.batch_size = batch_size
        self.batch_tokens = batch_tokens
        self.logits_fn = logits_fn
        self._device = next(model.parameters()).device

    @property
    def eot_token_id(self) -> int:
        return self.eos_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return self.tokenizer.encode(string, add_special_tokens=False).ids

    def window(self, context: list[int], continuation: list[int]) -> tuple[list[int], int]:
        """Model input (at most seq_len tokens, left-truncated) and how many of its last positions
        predict continuation tokens. A continuation longer than the context window keeps its tail."""
        whole = (context + continuation)[-(self.max_length + 1) :]
        return whole[:-1], min(len(continuation), len(whole) - 1)

    @torch.no_grad()
    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, **kwargs: Any) -> list:
        prepared = []
        for _, context, continuation in requests:
            if not continuation:
                raise ValueError("lm-eval sent an empty continuation; nothing to score")
            inputs, n_scored = self.window(context, continuation)
            prepared.append((inputs, continuation[-n_scored:]))

        results: list[tuple[float, bool] | None] = [None] * len(prepared)
        # Longest first: each batch pads to its first member, and shape changes are few.
        order = sorted(range(len(prepared)), key=lambda i: -len(prepared[i][0]))
        for chunk in self.batches(order, [len(inputs) for inputs, _ in prepared]):
            width = len(prepared[chunk[0]][0])
            batch = torch.full((len(chunk), width), self.eos_id, dtype=torch.long)
            for row, i in enumerate(chunk):
                inputs = prepared[i][0]
                batch[row, : len(inputs)] = torch.tensor(inputs)  # right padding: causal, never attended
            logprobs = torch.log_softmax(self.logits_fn(self.model, batch.to(self.device)).float(), dim=-1)
            for row, i in enumerate(chunk):
                inputs, targets = prepared[i]
                end = len(inputs)
                scored = logprobs[row, end - len(targets) : end]  # positions predicting the continuation
                target = torch.tensor(targets, device=scored.device)
                logprob = scored.gather(-1, target[:, None]).sum().item()
                greedy = bool((scored.argmax(-1) == target).all())
                results[i] = (logprob, greedy)
                (context_text, continuation_text) = requests[i][0]
                if context_text is not None:
                    self.cache_hook.add_partial("loglikelihood", (context_text, continuation_text), results[i])
        return results  # type: ignore[return-value]

    def batches(self, order: list[int], lengths: list[int]) -> list[list[int]]:
        """``order`` (longest first) cut into forward passes: batch_size rows each, or with batch_tokens as many
        rows as fit at the width of each pass's first row."""
        if self.batch_tokens is None:
            return [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        out, start = [], 0
        while start < len(order):
            rows = max(1, self.batch_tokens // lengths[order[start]])
            out.append(order[start : start + rows])
            start += rows
        return out

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """Whole-text log-likelihood in disjoint windows of seq_len (perplexity tasks)."""
        out = []
        for request in requests:
            (text,) = request.args
            windows = [
                make_disjoint_window(w)
                for w in get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                )
            ]
            scores = self._loglikelihood_tokens([((None, None), c, t) for c, t in windows])
            out.append(sum(s for s, _ in scores))
        return out

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        raise NotImplementedError(
            "prism eval scores log-likelihood (multiple-choice) tasks only; generation tasks are not supported"
        )


class DataParallelLM(PrismLM):
    """PrismLM over data-parallel ranks (GPT-NeoX's way of running lm-eval in training): lm-eval runs whole on
    every rank and sees one model; each DP rank scores its share of the requests and all ranks get every score.

    Shares are dealt from the longest request down, so each rank gets a like mix of lengths, and padded to one
    count, so at a fixed batch_size every rank runs the same number of forward passes (ZeRO-3 needs that).
    TP peers share a DP rank, hence the same requests, as the TP collectives inside the forward need."""

    def __init__(self, *args: Any, group: Any = None, **kwargs: Any):
        import torch.distributed as dist

        super().__init__(*args, **kwargs)
        self.group = group
        self.dp_rank, self.dp_size = dist.get_rank(group), dist.get_world_size(group)

    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, **kwargs: Any) -> list:
        import torch.distributed as dist

        if not requests:
            return []
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        mine = order[self.dp_rank :: self.dp_size]
        share = -(-len(requests) // self.dp_size)
        padded = mine + [order[0]] * (share - len(mine))  # repeats whose scores are dropped
        scores = super()._loglikelihood_tokens([requests[i] for i in padded], disable_tqdm)[: len(mine)]
        parts: list[Any] = [None] * self.dp_size
        dist.all_gather_object(parts, list(zip(mine, scores)), group=self.group)
        results: list[Any] = [None] * len(requests)
        for part in parts:
            for i, score in part:
                results[i] = score
        return results

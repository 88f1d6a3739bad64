"""Per-layer attention probabilities for analysis (attention distance), on eval forwards only.

Hooks are attached to each layer's core attention for the duration of the `with` and removed after, so
the training path is untouched. The probabilities are recomputed from the q and k the core attention
receives (softmax(q k^T / sqrt(d_h)) with the causal mask), so they are the same for both backends.
"""

from __future__ import annotations

import contextlib
import math

import torch

from pipeline.distributed import tp_all_gather


def _probs(query: torch.Tensor, key: torch.Tensor, scale: float | None) -> torch.Tensor:
    q, k = query.permute(1, 2, 0, 3).float(), key.permute(1, 2, 0, 3).float()  # [b, h, s, d_h]
    s = q.shape[-2]
    scores = (q @ k.transpose(-1, -2)) * (scale or 1.0 / math.sqrt(q.shape[-1]))
    causal = torch.ones(s, s, dtype=torch.bool, device=q.device).triu_(1)
    return scores.masked_fill_(causal, float("-inf")).softmax(dim=-1)


@contextlib.contextmanager
def capture_attention(model):
    """Yield {layer_number (1-based): [b, h_l, s, s] post-softmax probabilities}, filled by every forward
    inside the `with` (the last forward wins). The model must be in eval mode."""
    from pipeline.model.attention import PrismSelfAttention

    if model.training:
        raise RuntimeError("capture_attention is for eval forwards: call model.eval() first")
    captured: dict[int, torch.Tensor] = {}
    handles = []
    for module in model.modules():
        if not isinstance(module, PrismSelfAttention):
            continue
        core = module.core_attention
        scale = getattr(core, "softmax_scale", None)

        def hook(_mod, args, _layer=module.plan.number, _scale=scale, _whole=module.plan.replicated):
            with torch.no_grad():
                probs = _probs(args[0], args[1], _scale)
                captured[_layer] = probs if _whole else tp_all_gather(probs, dim=1)  # replicas hold all heads

        handles.append(core.register_forward_pre_hook(hook))
    try:
        yield captured
    finally:
        for h in handles:
            h.remove()

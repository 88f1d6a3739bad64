"""Which optimizer steps are skipped: decided on the device, once per step, with nothing read on the host.

A step is skipped when its loss (the mean over the micro-batches and data-parallel ranks) or its global grad
norm (before clipping) is NaN/inf, or above mean + train.skip_sigma * std of the last train.skip_window finite
steps (OLMo-core's SkipStepAdamW rule; it defaults to the same 128 steps and 6 sigma). A skipped step leaves
weights and AdamW state exactly as they were (pipeline.compat.SkipStepAdamW); its batches are still consumed,
so the data order does not depend on what is skipped.

Every finite step enters the window, skipped or not (as in OLMo-core): after a lasting jump of the loss the
window widens within a few steps (about window / sigma^2 = 4 at the defaults) and training goes on, where a
window of accepted steps only would skip for ever. NaN/inf never enters it. The spike test waits until the
window holds half its steps. The run stops (exit 4) after train.max_skips_in_a_row skips in a row (default 8:
twice what a lasting jump costs, and only 8 wasted steps when every step is NaN).

Every rank takes the same decision from the same inputs: the loss is all-reduced over the data-parallel group
and identical on tensor-parallel peers, the grad norm is DeepSpeed's global one. The window, the counters and
the decision are device tensors; they are read on sync steps only and saved in the checkpoint (state_dict),
so a resumed run skips exactly the steps the uninterrupted run would have.
"""

from __future__ import annotations

from typing import Any

import torch


class StepSkipper:
    """The spike window and the skip counters of one run, on the training device."""

    def __init__(self, window: int, sigma: float | None, device: Any) -> None:
        self.window, self.sigma, self.device = window, sigma, torch.device(device)
        self.losses = torch.zeros(window, device=self.device)
        self.norms = torch.zeros(window, device=self.device)
        self.recorded = torch.zeros((), dtype=torch.int64, device=self.device)  # finite steps ever recorded
        self.in_a_row = torch.zeros((), dtype=torch.int64, device=self.device)
        self.total = torch.zeros((), dtype=torch.int64, device=self.device)
        self._loss: torch.Tensor | None = None
        self._norm: torch.Tensor | None = None
        self._flag: torch.Tensor | None = None

    # --- one step: arm with the loss, decide at the optimizer step, finish after it -----------------------
    def arm(self, loss: torch.Tensor) -> None:
        """The step's loss, before DeepSpeed's boundary step runs the optimizer."""
        self._loss, self._norm, self._flag = loss.detach().float().reshape(()), None, None

    def decide(self, grad_norm: Any) -> torch.Tensor:
        """float32 1 (skip) or 0 for the armed step; the first call of a step decides, later ones repeat it."""
        if self._flag is None:
            if self._loss is None:
                raise RuntimeError("StepSkipper.decide before arm(loss): the step's loss is not known")
            # no norm (ZeRO-0): 0, a value that never spikes
            norm = 0.0 if grad_norm is None else grad_norm
            self._norm = torch.as_tensor(norm, dtype=torch.float32, device=self.device).reshape(())
            self._flag = self._skip(self._loss, self._norm).float()
        return self._flag

    def finish(self, grad_norm: Any) -> torch.Tensor:
        """After the step: record it; returns its 0/1 flag (decided now if DeepSpeed skipped the torch step
        itself, fp32 ZeRO on a NaN norm, so the optimizer never asked)."""
        flag = self.decide(grad_norm)
        finite = torch.isfinite(self._loss) & torch.isfinite(self._norm)
        slot = (torch.arange(self.window, device=self.device) == self.recorded % self.window) & finite
        self.losses.copy_(torch.where(slot, self._loss, self.losses))
        self.norms.copy_(torch.where(slot, self._norm, self.norms))
        self.recorded += finite.long()
        skip = flag.long()
        self.in_a_row.copy_((self.in_a_row + 1) * skip)
        self.total += skip
        self._loss = self._norm = self._flag = None
        return flag

    def _skip(self, loss: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
        bad = ~(torch.isfinite(loss) & torch.isfinite(norm))
        if self.sigma is None:
            return bad
        n = self.recorded.clamp(max=self.window)
        ready = n >= max(2, self.window // 2)
        spike = (loss > self._threshold(self.losses, n)) | (norm > self._threshold(self.norms, n))
        return bad | (ready & spike)

    def _threshold(self, values: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        """mean + sigma * std (unbiased) of the first n slots; the slot order is fixed, so is the rounding."""
        held = torch.arange(self.window, device=self.device) < n
        count = n.float().clamp(min=1.0)
        mean = torch.where(held, values, 0.0).sum() / count
        var = torch.where(held, values - mean, 0.0).square().sum() / (count - 1.0).clamp(min=1.0)
        return mean + self.sigma * var.sqrt()

    # --- the checkpoint -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Host values (a sync: checkpoint steps only)."""
        return {
            "losses": self.losses.tolist(),
            "norms": self.norms.tolist(),
            "recorded": int(self.recorded),
            "in_a_row": int(self.in_a_row),
            "total": int(self.total),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The saved window as it was; saved with another train.skip_window: its newest steps, oldest first."""
        losses, norms, recorded = state["losses"], state["norms"], state["recorded"]
        if len(losses) != self.window:
            held = min(recorded, len(losses))
            start = recorded % len(losses) if recorded > len(losses) else 0
            order = [(start + i) % len(losses) for i in range(held)][-self.window :]
            losses, norms, recorded = [losses[i] for i in order], [norms[i] for i in order], len(order)
            losses, norms = losses + [0.0] * (self.window - recorded), norms + [0.0] * (self.window - recorded)
        self.losses.copy_(torch.tensor(losses))
        self.norms.copy_(torch.tensor(norms))
        self.recorded.fill_(recorded)
        self.in_a_row.fill_(state["in_a_row"])
        self.total.fill_(state["total"])

"""torch.optim behaviour Prism relies on beyond the documented API: the fused AdamW kernel's ``found_inf``.

torch's GradScaler skips an inf/NaN step by setting ``grad_scale`` / ``found_inf`` attributes on the optimizer,
which Adam/AdamW hand to their kernels. The fused kernel (CUDA, and CPU since torch 2.4) returns without
touching parameters or moments when ``found_inf`` is 1, and ``_fused_adam`` subtracts ``found_inf`` from the
step counts it has just incremented: the step is gone, on the device, with nothing read on the host. The
per-tensor loop and foreach kernels refuse the attribute (an AssertionError), so SkipStepAdamW is fused only.
tests/unit/test_skipping.py checks the exact no-op on the installed torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class SkipStepAdamW(torch.optim.AdamW):
    """Fused torch AdamW whose update is dropped on the device when ``skip_flag()`` returns 1.

    ``skip_flag``: None (a plain fused AdamW) or a callable giving a float32 0/1 scalar on the parameters'
    device; it is asked once per ``step`` call (DeepSpeed's ZeRO-3 steps sub-groups one call each, so the
    callable must give the same answer for every call of one optimizer step)."""

    def __init__(self, params: Any, skip_flag: Callable[[], torch.Tensor] | None = None, **kwargs: Any) -> None:
        if not kwargs.get("fused"):
            raise ValueError("SkipStepAdamW needs fused=True: only the fused kernel skips through found_inf")
        super().__init__(params, **kwargs)
        self.skip_flag = skip_flag

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        if self.skip_flag is not None:
            self.found_inf = self.skip_flag()
        return super().step(closure)

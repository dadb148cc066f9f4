"""Local AdaAlter under ``torch.amp.GradScaler``: the optimizer unscales, and the ranks agree on skipping.

``LocalAdaAlter`` sets ``_step_supports_amp_scaling``, so ``GradScaler.step``
calls its ``step()`` even when it found inf/NaN, having set ``grad_scale`` and
``found_inf`` on it, and the optimizer unscales the gradients itself. During
local steps all ranks agree on skipping a step with a one-float ``MAX``
allreduce of ``found_inf``, so a rank that saw inf/NaN never falls out of
step. A skipped step does not advance the schedule (the hook stays in its
phase). In warm-up the averaged gradients already agree, so no extra
collective is needed. Only the ranks' loss scales may differ after a local
skip, which is harmless because local gradients are never mixed.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["inverse_scale", "skip_step"]


def inverse_scale(grad_scale: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``1 / grad_scale`` as float32, computed in float64 as ``GradScaler.unscale_`` does; ``None`` without
    a scaler."""
    return None if grad_scale is None else grad_scale.double().reciprocal().float()


def skip_step(found_inf: Optional[torch.Tensor], *, agree: bool, group) -> bool:
    """Whether ``GradScaler``'s ``found_inf`` (``None`` without a scaler) says to skip the step.

    With ``agree`` (local steps on several ranks) the flag first goes through
    one one-float ``MAX`` allreduce in ``group``, so that every rank skips alike.
    """
    if found_inf is None:
        return False
    flag = found_inf.detach().to(torch.float32).reshape(1).clone()
    if agree:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item() > 0)

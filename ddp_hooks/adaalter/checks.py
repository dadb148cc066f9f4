"""Argument checks that Local AdaAlter's optimizer, its builder and the baselines share.

They add to :mod:`ddp_hooks._internal.validation` (whose checks they use) what
the Local AdaAlter side alone needs; like those, each error names the
argument, the value received, the rule and why it holds.
"""

from __future__ import annotations

import torch

from .._internal.validation import check_float

__all__ = ["check_positive", "check_ddp_model"]


def check_positive(name: str, value, reason: str) -> float:
    """``value`` as a float if it is a finite number > 0; else ``TypeError``/``ValueError`` naming ``name``
    and ``reason``."""
    return check_float(name, value, 0.0, float("inf"), low_open=True, high_open=True, reason=reason)


def check_ddp_model(ddp_model) -> None:
    """``TypeError`` unless ``ddp_model`` is a ``DistributedDataParallel`` model (the builders register a
    comm hook on it)."""
    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(f"`ddp_model` must be a DistributedDataParallel model, got {type(ddp_model).__name__}")

"""Random-k: a uniform random k-subset of each unit, recomputable by every rank from ``(seed, step, unit, rank)``.

The draws themselves (SplitMix64 counters, first draws, one slot per kept
value) are :func:`~.draws.random_subsets`, shared with random-block, which
draws its blocks the same way.

Example::

    >>> import torch
    >>> from ddp_hooks.sparsify.selectors import SelectionRequest, Unit
    >>> request = SelectionRequest(units=(Unit(0, 0, 100), Unit(1, 100, 50)), density=0.1, seed=0, step=3,
    ...                            device=torch.device("cpu"))
    >>> positions = RandomK().select(request)
    >>> positions.numel(), bool((positions[:10] < 100).all()), positions.unique().numel()
    (15, True, 15)
"""

from __future__ import annotations

from typing import Tuple

import torch

from .base import SelectionRequest, Selector
from .draws import random_subsets

__all__ = ["RandomK"]


class RandomK(Selector):
    """A uniform k-subset per unit from ``(seed, step, unit, rank)``: recomputable anywhere, so only values travel."""

    name = "randomk"
    code = 1
    leaves_at_random_times = True

    def choose(self, request: SelectionRequest, ks: Tuple[int, ...]) -> torch.Tensor:
        units = request.units
        return random_subsets([u.offset for u in units], [u.numel for u in units], ks, [u.key for u in units],
                              request.seed, request.step, request.rank, request.where, request.reads_on_host)

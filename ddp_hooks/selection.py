"""Coordinate selectors C_k: pure tensor functions, no ``torch.distributed``.

A *unit* is a contiguous range ``[offset, offset + numel)`` of a flat vector
(a layer inside a bucket, a whole bucket, or every bucket of a step). Each
unit gets a budget ``k = ceil(density * numel)`` and a selector returns the
absolute positions of the ``k`` coordinates it keeps:

* ``topk``: the k entries of largest magnitude (exact; :mod:`ddp_hooks.topk_selection`).
* ``randomk``: a uniformly random k-subset (:mod:`ddp_hooks.randomk_selection`).
* ``random_block``: a uniformly random set of blocks of ``block_size``
  consecutive positions, k positions in all, every coordinate sent with
  probability exactly ``k / n`` (:mod:`ddp_hooks.block_selection`).

A unit whose budget covers it entirely is sent whole and in order, so
``density=1`` reproduces a plain allreduce bit for bit.

Example::

    >>> import torch
    >>> from ddp_hooks.selection import Unit, budget, select
    >>> p = torch.tensor([0.1, -3.0, 0.2, 2.0, 0.0, 0.5])
    >>> units = [Unit(key=0, offset=0, numel=3), Unit(key=1, offset=3, numel=3)]
    >>> [budget(u.numel, 0.34) for u in units]
    [2, 2]
    >>> sorted(select("topk", p, units, 0.34, seed=0, step=0).tolist())
    [1, 2, 3, 5]
    >>> idx = select("random_block", p, units, 0.34, seed=0, step=0, block_size=2)
    >>> idx.numel()
    4
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import NamedTuple, Optional, Sequence, Tuple

import torch

from .block_selection import random_blocks
from .randomk_selection import random_subsets
from ._internal.seeding import SHARED
from .topk_selection import topk_units

METHODS = ("topk", "randomk", "random_block")


class Unit(NamedTuple):
    """A contiguous range of the flat vector that gets its own budget."""

    key: int  # identifies the unit for seeding: parameter key, bucket index, or 0
    offset: int
    numel: int


def budget(numel: int, density: float) -> int:
    """``ceil(density * numel)``, at least 1, at most ``numel``.

    The product is rounded to 6 decimals first so that float noise
    (``0.07 * 100 == 7.000000000000001``) does not add a coordinate.
    """
    return min(numel, max(1, math.ceil(round(density * numel, 6))))


def total_budget(units: Sequence[Unit], density: float) -> int:
    return sum(_budgets(tuple(units), density))


@lru_cache(maxsize=1024)
def _budgets(units: Tuple[Unit, ...], density: float) -> Tuple[int, ...]:
    """Each unit's budget; cached, as a bucket's units repeat every step."""
    return tuple(budget(u.numel, density) for u in units)


def select(
    method: str,
    values: torch.Tensor,
    units: Sequence[Unit],
    density: float,
    seed: int,
    step: int,
    rank: int = SHARED,
    block_size: int = 16,
) -> torch.Tensor:
    """Positions (int64, 1-D, on ``values.device``) kept by ``method`` in each unit.

    Args:
        method (str): ``"topk"``, ``"randomk"`` or ``"random_block"``.
        values (Tensor): the flat compensated vector ``p = g + e``; only
            ``topk`` reads it, the random selectors only use its device.
        units: the units of selection, each with budget ``ceil(density * numel)``.
        density (float): fraction kept, in (0, 1].
        seed, step (int): with the unit's key and ``rank``, the random choice.
        rank (int): ``SHARED`` (-1) when all ranks must choose alike
            (AllReduce), else the rank whose choice this is (AllGather).
        block_size (int): ``random_block`` only: entries per block.

    Returns:
        The concatenation over units of each unit's positions, unit by unit.
    """
    device = values.device
    units = tuple(units)
    ks = _budgets(units, density)
    if method not in METHODS:
        raise ValueError(f"`method` must be one of {', '.join(repr(m) for m in METHODS)}, got {method!r}")
    if all(k == u.numel for u, k in zip(units, ks)):  # density 1: everything, in order
        return torch.cat([torch.arange(u.offset, u.offset + u.numel, device=device) for u in units])
    if not _ascending(units):  # the vectorised selectors need units in increasing position
        return torch.cat([select(method, values, [u], density, seed, step, rank, block_size) for u in units])
    offsets, sizes = [u.offset for u in units], [u.numel for u in units]
    if method == "random_block":
        return random_blocks(offsets, sizes, ks, [u.key for u in units], block_size, seed, step, rank, device)
    if method == "topk":
        return topk_units(values.abs(), offsets, sizes, ks)
    return random_subsets(offsets, sizes, ks, [u.key for u in units], seed, step, rank, device)


def select_topk(magnitude: torch.Tensor, units: Sequence[Unit], density: float,
                mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``select("topk", p, ...)`` given ``magnitude = |p|`` and an optional bool scratch ``mask``.

    The hook computes ``|p|`` into memory it keeps from step to step; a fresh
    25 MB allocation per bucket costs page faults on the CPU.
    """
    units = tuple(units)
    ks = _budgets(units, density)
    if all(k == u.numel for u, k in zip(units, ks)) or not _ascending(units):
        return select("topk", magnitude, units, density, 0, 0)
    return topk_units(magnitude, [u.offset for u in units], [u.numel for u in units], ks, mask)


def _ascending(units: Sequence[Unit]) -> bool:
    return all(a.offset + a.numel <= b.offset for a, b in zip(units, units[1:]))

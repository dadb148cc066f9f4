"""Coordinate selectors C_k: pure tensor functions, no ``torch.distributed``.

A *unit* is a contiguous range ``[offset, offset + numel)`` of a flat vector
(a layer inside a bucket, a whole bucket, or every bucket of a step). Each
unit gets a budget ``k = ceil(density * numel)`` and a selector returns the
absolute positions of the ``k`` coordinates it keeps:

* ``topk``: the k entries of largest magnitude (exact; :mod:`ddp_hooks.topk_selection`).
* ``randomk``: a uniformly random k-subset (:mod:`ddp_hooks.randomk_selection`).
* ``random_block``: the k consecutive positions starting at a uniformly random
  offset ``s`` and *wrapping around* the end of the unit, ``(s + j) mod n``
  for ``j < k``. Every coordinate is then covered with probability exactly
  ``k / n``; a start drawn from ``[0, n - k]`` would almost never cover the
  first and last coordinates, whose residuals would grow without draining.

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
    >>> idx = select("random_block", p, units, 0.34, seed=0, step=0)
    >>> idx.numel()
    4
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import NamedTuple, Optional, Sequence, Tuple

import torch

from .randomk_selection import random_subsets
from .seeding import _MASK64, SHARED, _shift_right, derive_seed, derive_seeds
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


class _BlockPlan(NamedTuple):
    """Device tensors of one layout of units for :func:`_block_positions`; only the starts change per step."""

    total: int  # positions in all
    firsts: torch.Tensor  # index of each unit's first position in the output
    ks: torch.Tensor
    size: torch.Tensor
    offset: torch.Tensor
    keys: torch.Tensor
    whole: Optional[torch.Tensor]  # units sent whole (their block starts at 0), or None if there are none


@lru_cache(maxsize=256)
def _block_plan(units: Tuple[Unit, ...], ks: Tuple[int, ...], device: torch.device) -> _BlockPlan:
    """Cached: a bucket's layout rarely changes."""
    ks_t = torch.tensor(ks, device=device)
    whole = [k == u.numel for u, k in zip(units, ks)]
    return _BlockPlan(int(sum(ks)), torch.cumsum(ks_t, 0) - ks_t, ks_t,
                      torch.tensor([u.numel for u in units], device=device),
                      torch.tensor([u.offset for u in units], device=device),
                      torch.tensor([u.key for u in units], device=device),
                      torch.tensor(whole, device=device) if any(whole) else None)


def _block_start(seed64: int, numel: int) -> int:
    """The block's first position within its unit, from the unit's derived seed."""
    return ((seed64 & _MASK64) >> 1) % numel


def _block_positions(units: Sequence[Unit], ks: Sequence[int], seed: int, step: int, rank: int,
                     device: torch.device) -> torch.Tensor:
    """Absolute positions of one wrapped block per unit: ``offset + (start + j) mod n``, ``j < k``.

    A unit sent whole starts at 0. With several units the starts are derived
    on the device (:func:`~ddp_hooks.seeding.derive_seeds`), so on a GPU no
    tensor crosses between host and device.
    """
    if len(units) == 1:
        (u,), (k,) = units, ks
        s = 0 if k == u.numel else _block_start(derive_seed(seed, step, u.key, rank), u.numel)
        if s + k <= u.numel:  # no wrap: one range
            return torch.arange(u.offset + s, u.offset + s + k, device=device)
        return torch.cat([torch.arange(u.offset + s, u.offset + u.numel, device=device),
                          torch.arange(u.offset, u.offset + s + k - u.numel, device=device)])
    plan = _block_plan(tuple(units), tuple(ks), torch.device(device))
    start = _shift_right(derive_seeds(seed, step, plan.keys, rank), 1).remainder_(plan.size)
    if plan.whole is not None:
        start.masked_fill_(plan.whole, 0)
    # The positions are a running sum of steps: 1 inside a block, a jump at
    # each block's first position, 1 - n where a block wraps. One cumsum over
    # the positions, where ``(start + j) mod n`` needs a gather of each unit's
    # start and an integer division per position.
    first = plan.offset + start
    wraps = (start + plan.ks > plan.size).long()
    last = first + plan.ks - 1 - plan.size * wraps
    previous_last = torch.cat([last.new_zeros(1), last[:-1]])  # the sum starts from 0
    steps = torch.ones(plan.total, dtype=torch.int64, device=start.device)
    steps.index_add_(0, plan.firsts, first - previous_last - 1)
    wrap_at = plan.firsts + torch.minimum(plan.size - start, plan.ks - 1)  # inside the block even without a wrap
    steps.index_add_(0, wrap_at, -plan.size * wraps)
    return torch.cumsum(steps, 0)


def select(
    method: str,
    values: torch.Tensor,
    units: Sequence[Unit],
    density: float,
    seed: int,
    step: int,
    rank: int = SHARED,
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

    Returns:
        The concatenation over units of each unit's positions, unit by unit.
    """
    device = values.device
    units = tuple(units)
    ks = _budgets(units, density)
    if method == "random_block":
        return _block_positions(units, ks, seed, step, rank, device)
    if method not in METHODS:
        raise ValueError(f"`method` must be one of {', '.join(repr(m) for m in METHODS)}, got {method!r}")
    if all(k == u.numel for u, k in zip(units, ks)):  # density 1: everything, in order
        return torch.cat([torch.arange(u.offset, u.offset + u.numel, device=device) for u in units])
    if not _ascending(units):  # the vectorised selectors need units in increasing position
        return torch.cat([select(method, values, [u], density, seed, step, rank) for u in units])
    offsets, sizes = [u.offset for u in units], [u.numel for u in units]
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

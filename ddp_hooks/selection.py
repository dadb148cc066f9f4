"""Coordinate selectors C_k: pure tensor functions, no ``torch.distributed``.

A *unit* is a contiguous range ``[offset, offset + numel)`` of a flat vector
(a layer inside a bucket, a whole bucket, or every bucket of a step). Each
unit gets a budget ``k = ceil(density * numel)`` and a selector returns the
absolute positions of the ``k`` coordinates it keeps:

* ``topk``: the k entries of largest magnitude (ties broken by ``torch.topk``).
* ``randomk``: a uniformly random k-subset.
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
from typing import List, NamedTuple, Sequence

import torch

from .seeding import SHARED, derive_seed, generator_for

METHODS = ("topk", "randomk", "random_block")

# Below this many elements a random k-subset comes from a full permutation;
# above it, from draws with replacement, which cost O(k) instead of O(n).
_PERMUTATION_LIMIT = 1 << 16


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
    return sum(budget(u.numel, density) for u in units)


def random_subset(n: int, k: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """A uniformly random k-subset of ``range(n)`` as an int64 tensor (unordered).

    For large ``n`` it draws with replacement until ``k`` distinct values
    appear, then keeps a uniformly random ``k`` of them; by symmetry the
    result is a uniform k-subset, at O(k log k) instead of O(n).
    """
    if k >= n:
        return torch.arange(n, device=device)
    if n <= _PERMUTATION_LIMIT or 4 * k >= n:
        return torch.randperm(n, generator=generator, device=device)[:k]
    draws = k + (k * k) // n + 64
    while True:
        candidates = torch.unique(torch.randint(0, n, (draws,), generator=generator, device=device))
        if candidates.numel() >= k:
            keep = torch.randperm(candidates.numel(), generator=generator, device=device)[:k]
            return candidates[keep]
        draws *= 2


def topk_positions(values: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the ``k`` largest magnitudes of a 1-D tensor (exact, unordered).

    ``torch.topk`` over millions of entries costs tens of times a pass over
    them. For large inputs a threshold is first estimated from an evenly
    strided sample of magnitudes, aimed at about ``2k`` candidates; the exact
    top-k of the candidates is the exact top-k of the whole (any entry above
    the k-th largest is above the threshold). When the estimate lets through
    fewer than ``k`` candidates, the full ``torch.topk`` is used instead, so
    the result never depends on the sample, only the speed does.
    """
    n = values.numel()
    magnitude = values.abs()
    if n < (1 << 17) or 16 * k > n:
        return torch.topk(magnitude, k, sorted=False).indices
    sample = magnitude[:: n // (1 << 14)]
    rank_in_sample = max(1, sample.numel() - (2 * k * sample.numel()) // n)
    threshold = sample.kthvalue(rank_in_sample).values
    candidates = torch.nonzero(magnitude >= threshold).squeeze(1)
    if candidates.numel() < k:
        return torch.topk(magnitude, k, sorted=False).indices
    return candidates[torch.topk(magnitude[candidates], k, sorted=False).indices]


def _block_positions(units: Sequence[Unit], ks: Sequence[int], starts: Sequence[int], device) -> torch.Tensor:
    """Absolute positions of one wrapped block per unit, built with a few vector ops."""
    if len(units) == 1:
        (u,), (k,), (s,) = units, ks, starts
        return torch.arange(s, s + k, device=device).remainder_(u.numel).add_(u.offset)
    ks_t = torch.tensor(ks, device=device)
    total = int(sum(ks))
    first = torch.cumsum(ks_t, 0) - ks_t  # where each unit's block begins in the output
    within = torch.arange(total, device=device) - torch.repeat_interleave(first, ks_t, output_size=total)
    starts_t = torch.repeat_interleave(torch.tensor(starts, device=device), ks_t, output_size=total)
    sizes_t = torch.repeat_interleave(torch.tensor([u.numel for u in units], device=device), ks_t, output_size=total)
    offsets_t = torch.repeat_interleave(torch.tensor([u.offset for u in units], device=device), ks_t, output_size=total)
    return (within + starts_t).remainder_(sizes_t).add_(offsets_t)


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
    ks = [budget(u.numel, density) for u in units]
    if method == "random_block":
        starts = [
            0 if k == u.numel else derive_seed(seed, step, u.key, rank) % u.numel for u, k in zip(units, ks)
        ]
        return _block_positions(units, ks, starts, device)
    parts: List[torch.Tensor] = []
    for u, k in zip(units, ks):
        if k == u.numel:
            parts.append(torch.arange(u.offset, u.offset + u.numel, device=device))
        elif method == "topk":
            parts.append(topk_positions(values[u.offset : u.offset + u.numel], k).add_(u.offset))
        elif method == "randomk":
            gen = generator_for(derive_seed(seed, step, u.key, rank), device)
            parts.append(random_subset(u.numel, k, gen, device).add_(u.offset))
        else:
            raise ValueError(f"`method` must be one of {', '.join(repr(m) for m in METHODS)}, got {method!r}")
    return parts[0] if len(parts) == 1 else torch.cat(parts)

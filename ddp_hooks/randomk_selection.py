"""Uniform random k-subsets of many units at once, from a counter-based hash.

Each unit ``u`` (a range ``[offset_u, offset_u + n_u)`` with budget ``k_u``
and its own 64-bit seed ``s_u`` from :func:`~ddp_hooks.seeding.derive_seed`)
needs ``k_u`` distinct positions, every ``k_u``-subset equally likely. All
units are drawn together, with no generator per unit:

1. ``d_u`` draws with replacement, ``x_j = splitmix64(s_u + j * gamma) mod n_u``
   for ``j < d_u`` (gamma the SplitMix64 increment, so nearby seeds give
   unrelated streams), with ``d_u`` a little above the expected number of
   draws that yields ``k_u`` distinct values, ``n_u ln(n_u / (n_u - k_u))``;
2. one stable sort by (unit, position) finds each value's first draw;
3. each unit keeps the first ``k_u`` distinct values in draw order.

Drawing with replacement and skipping repeats until ``k_u`` distinct values
have come is sequential sampling without replacement, so the result is
exactly a uniform ``k_u``-subset. A unit whose draws fall short (rare: the
margin is three standard deviations plus 64) draws twice as many. A large unit
with a budget of a quarter or more of it takes a seeded ``torch.randperm``
instead, which is cheaper there. Everything else is a pure function of the
seeds, identical on every device.

Example::

    >>> import torch
    >>> idx = random_subsets([0, 100], [100, 10_000], [5, 50], [11, 12], torch.device("cpu"))
    >>> idx.numel(), bool((idx[:5] < 100).all()), bool((idx[5:] >= 100).all()), idx.unique().numel()
    (55, True, True, 55)
"""

from __future__ import annotations

import math
from typing import List, Sequence

import torch

from .seeding import _GAMMA, _to_signed, generator_for, splitmix64_tensor, uniform_below

__all__ = ["random_subsets"]

# A unit larger than this whose budget is a quarter of it or more uses randperm.
_DRAW_LIMIT = 1 << 12


def _draws(n: int, k: int) -> int:
    """Draws with replacement that give ``k`` distinct values of ``n`` with a wide margin."""
    expected = n * math.log(n / (n - k + 0.5))
    return int(expected + 3 * math.sqrt(expected)) + 64


def random_subsets(offsets: Sequence[int], sizes: Sequence[int], ks: Sequence[int],
                   seeds: Sequence[int], device: torch.device) -> torch.Tensor:
    """Absolute positions: a uniform ``ks[u]``-subset of each unit, unit by unit (unordered within a unit).

    Args:
        offsets, sizes (ints): each unit's first position and length.
        ks (ints): each unit's budget, ``1 <= ks[u] <= sizes[u]``.
        seeds (ints): each unit's 64-bit seed.
        device: where the positions are made.
    """
    dense = [n > _DRAW_LIMIT and 4 * k >= n for n, k in zip(sizes, ks)]
    drawn = [u for u, d in enumerate(dense) if not d]
    from_draws = _first_distinct_draws([offsets[u] for u in drawn], [sizes[u] for u in drawn],
                                       [ks[u] for u in drawn], [seeds[u] for u in drawn],
                                       [_draws(sizes[u], ks[u]) for u in drawn], device) if drawn else None
    if not any(dense):
        return from_draws
    parts: List[torch.Tensor] = []
    taken = 0
    for o, n, k, s, d in zip(offsets, sizes, ks, seeds, dense):
        if d:
            parts.append(torch.randperm(n, generator=generator_for(s, device), device=device)[:k].add_(o))
        else:
            parts.append(from_draws[taken:taken + k])
            taken += k
    return torch.cat(parts)


def _first_distinct_draws(offsets, sizes, ks, seeds, draws, device) -> torch.Tensor:
    """For each unit, the first ``k_u`` distinct values of ``d_u`` hashed draws (one stable sort)."""
    units = len(sizes)
    counts = torch.tensor(draws, device=device)
    unit = torch.repeat_interleave(torch.arange(units, device=device), counts, output_size=sum(draws))
    first = torch.cumsum(counts, 0) - counts
    j = torch.arange(unit.numel(), device=device) - first.index_select(0, unit)
    seed = torch.tensor([_to_signed(s) for s in seeds], device=device).index_select(0, unit)
    size = torch.tensor(sizes, device=device).index_select(0, unit)
    position = uniform_below(splitmix64_tensor(seed + j * _GAMMA), size)
    # Stable sort by (unit, position): the first entry of each run of equal
    # values is that value's first draw.
    position_bits = max(1, (max(sizes) - 1).bit_length())
    composite = (unit << position_bits) | position
    if position_bits + units.bit_length() <= 31:
        composite = composite.int()  # int32 sorts about twice as fast as int64 on the CPU
    grouped, order = torch.sort(composite, stable=True)
    first_of_run = torch.ones_like(grouped, dtype=torch.bool)
    first_of_run[1:] = grouped[1:] != grouped[:-1]
    new_value = torch.empty_like(first_of_run).scatter_(0, order, first_of_run)  # back in draw order
    seen_before = torch.cumsum(new_value, 0) - new_value.long()  # distinct values drawn earlier
    rank = seen_before - seen_before.index_select(0, first).index_select(0, unit)
    ks_t = torch.tensor(ks, device=device)
    have = rank.index_select(0, first + counts - 1) + new_value.index_select(0, first + counts - 1)
    short = torch.nonzero(have < ks_t).squeeze(1).tolist()
    if short:  # very unlikely: those units draw twice as many
        more = list(draws)
        for u in short:
            more[u] = 2 * draws[u]
        return _first_distinct_draws(offsets, sizes, ks, seeds, more, device)
    keep = torch.nonzero(new_value & (rank < ks_t.index_select(0, unit))).squeeze(1)
    offsets_t = torch.tensor(offsets, device=device)
    return position.index_select(0, keep) + offsets_t.index_select(0, unit.index_select(0, keep))

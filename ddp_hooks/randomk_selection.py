"""Uniform random k-subsets of many units at once, from a counter-based hash.

Each unit ``u`` (a range ``[offset_u, offset_u + n_u)`` with budget ``k_u``
and its own 64-bit seed ``s_u = derive_seed(seed, step, key_u, rank)``, derived on the device)
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
    >>> idx = random_subsets([0, 100], [100, 10_000], [5, 50], keys=[3, 4], seed=0, step=7, rank=-1,
    ...                      device=torch.device("cpu"))
    >>> idx.numel(), bool((idx[:5] < 100).all()), bool((idx[5:] >= 100).all()), idx.unique().numel()
    (55, True, True, 55)
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import List, NamedTuple, Sequence, Tuple

import torch

from .seeding import _GAMMA, derive_seed, derive_seeds, generator_for, splitmix64_tensor, uniform_below

__all__ = ["random_subsets"]

# A unit larger than this whose budget is a quarter of it or more uses randperm.
_DRAW_LIMIT = 1 << 12


def _draws(n: int, k: int) -> int:
    """Draws with replacement that give ``k`` distinct values of ``n`` with a wide margin."""
    expected = n * math.log(n / (n - k + 0.5))
    return int(expected + 3 * math.sqrt(expected)) + 64


def random_subsets(offsets: Sequence[int], sizes: Sequence[int], ks: Sequence[int], keys: Sequence[int],
                   seed: int, step: int, rank: int, device: torch.device) -> torch.Tensor:
    """Absolute positions: a uniform ``ks[u]``-subset of each unit, unit by unit (unordered within a unit).

    Args:
        offsets, sizes (ints): each unit's first position and length.
        ks (ints): each unit's budget, ``1 <= ks[u] <= sizes[u]``.
        keys (ints): each unit's key; with ``seed``, ``step`` and ``rank`` it
            gives the unit's seed ``derive_seed(seed, step, key, rank)``.
        device: where the positions are made.
    """
    dense = [n > _DRAW_LIMIT and 4 * k >= n for n, k in zip(sizes, ks)]
    drawn = [u for u, d in enumerate(dense) if not d]
    from_draws = None
    if drawn:
        plan = _plan(tuple(offsets[u] for u in drawn), tuple(sizes[u] for u in drawn),
                     tuple(ks[u] for u in drawn), tuple(keys[u] for u in drawn),
                     tuple(_draws(sizes[u], ks[u]) for u in drawn), torch.device(device))
        from_draws = _first_distinct_draws(plan, seed, step, rank)
    if not any(dense):
        return from_draws
    parts: List[torch.Tensor] = []
    taken = 0
    for o, n, k, key, d in zip(offsets, sizes, ks, keys, dense):
        if d:
            gen = generator_for(derive_seed(seed, step, key, rank), device)
            parts.append(torch.randperm(n, generator=gen, device=device)[:k].add_(o))
        else:
            parts.append(from_draws[taken:taken + k])
            taken += k
    return torch.cat(parts)


class _Plan(NamedTuple):
    """Device tensors of one layout of drawn units; only the seeds change from step to step."""

    offsets: Tuple[int, ...]
    sizes: Tuple[int, ...]
    ks: Tuple[int, ...]
    keys: Tuple[int, ...]
    draws: Tuple[int, ...]
    unit: torch.Tensor  # unit of each draw
    j: torch.Tensor  # index of each draw within its unit
    size: torch.Tensor  # size of the unit of each draw
    first: torch.Tensor  # first draw of each unit
    last: torch.Tensor  # last draw of each unit
    ks_t: torch.Tensor
    offsets_t: torch.Tensor
    keys_t: torch.Tensor
    position_bits: int


@lru_cache(maxsize=256)
def _plan(offsets, sizes, ks, keys, draws, device) -> _Plan:
    counts = torch.tensor(draws, device=device)
    unit = torch.repeat_interleave(torch.arange(len(sizes), device=device), counts, output_size=sum(draws))
    first = torch.cumsum(counts, 0) - counts
    j = torch.arange(unit.numel(), device=device) - first.index_select(0, unit)
    size = torch.tensor(sizes, device=device).index_select(0, unit)
    return _Plan(offsets, sizes, ks, keys, draws, unit, j, size, first, first + counts - 1,
                 torch.tensor(ks, device=device), torch.tensor(offsets, device=device),
                 torch.tensor(keys, device=device), max(1, (max(sizes) - 1).bit_length()))


def _first_distinct_draws(plan: _Plan, seed: int, step: int, rank: int) -> torch.Tensor:
    """For each unit, the first ``k_u`` distinct values of ``d_u`` hashed draws (one stable sort)."""
    unit, first = plan.unit, plan.first
    unit_seed = derive_seeds(seed, step, plan.keys_t, rank).index_select(0, unit)
    position = uniform_below(splitmix64_tensor(unit_seed + plan.j * _GAMMA), plan.size)
    # Stable sort by (unit, position): the first entry of each run of equal
    # values is that value's first draw.
    composite = (unit << plan.position_bits) | position
    if plan.position_bits + len(plan.sizes).bit_length() <= 31:
        composite = composite.int()  # int32 sorts about twice as fast as int64 on the CPU
    grouped, order = torch.sort(composite, stable=True)
    first_of_run = torch.ones_like(grouped, dtype=torch.bool)
    first_of_run[1:] = grouped[1:] != grouped[:-1]
    new_value = torch.empty_like(first_of_run).scatter_(0, order, first_of_run)  # back in draw order
    seen_before = torch.cumsum(new_value, 0) - new_value.long()  # distinct values drawn earlier
    rank_in_unit = seen_before - seen_before.index_select(0, first).index_select(0, unit)
    have = rank_in_unit.index_select(0, plan.last) + new_value.index_select(0, plan.last)
    short = torch.nonzero(have < plan.ks_t).squeeze(1).tolist()  # a device-to-host sync
    if short:  # very unlikely: those units draw twice as many
        more = list(plan.draws)
        for u in short:
            more[u] = 2 * more[u]
        bigger = _plan(plan.offsets, plan.sizes, plan.ks, plan.keys, tuple(more), unit.device)
        return _first_distinct_draws(bigger, seed, step, rank)
    keep = torch.nonzero(new_value & (rank_in_unit < plan.ks_t.index_select(0, unit))).squeeze(1)
    return position.index_select(0, keep) + plan.offsets_t.index_select(0, unit.index_select(0, keep))

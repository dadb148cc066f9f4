"""Random-k: a uniform random k-subset of each unit, for many units at once, from a counter-based hash.

Each unit ``u`` (a range ``[offset_u, offset_u + n_u)`` with budget ``k_u``
and its own 64-bit seed ``s_u = derive_seed(seed, step, key_u, rank)``, derived on the device)
needs ``k_u`` distinct positions, every ``k_u``-subset equally likely. All
units are drawn together, with no generator per unit:

1. ``d_u`` draws with replacement, ``x_j = splitmix64(s_u + j * gamma) mod n_u``
   for ``j < d_u`` (gamma the SplitMix64 increment, so nearby seeds give
   unrelated streams), with ``d_u`` a little above the expected number of
   draws that yields ``k_u`` distinct values, ``n_u ln(n_u / (n_u - k_u))``;
2. each value's first draw is marked (:func:`~.first_draws.first_draws`:
   a table of first draws, or one stable sort of the absolute positions;
   units are disjoint, so a value's first draw overall is its first in its
   unit);
3. each unit keeps the first ``k_u`` distinct values in draw order.

Drawing with replacement and skipping repeats until ``k_u`` distinct values
have come is sequential sampling without replacement, so the result is
exactly a uniform ``k_u``-subset. A unit whose draws fall short (rare: the
margin is six standard deviations plus 8, see :func:`_draws`) draws twice as
many; as the draws are a fixed sequence, that changes nothing in the choice.
A large unit with a budget of a quarter or more of it takes a seeded
``torch.randperm`` instead, which is cheaper there. Everything else is a pure function of the
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
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch

from ..._internal.seeding import GAMMA, derive_seed, derive_seeds, generator_for, splitmix64_tensor, uniform_below

from .base import SelectionRequest, Selector
from .first_draws import first_draws
from .plans import one_plan_per_layout

__all__ = ["RandomK", "random_subsets", "DrawPlan", "split_units", "draw_plan"]

# A unit larger than this whose budget is a quarter of it or more uses randperm.
_DRAW_LIMIT = 1 << 12


def _draws(n: int, k: int) -> int:
    """Draws with replacement that give ``k`` distinct values of ``n`` but for a vanishing chance.

    The draws needed, ``D``, have mean ``sum_{i<k} n / (n - i)`` and variance
    ``sum_{i<k} (i / n) / (1 - i / n)**2``; both sums are bounded above by
    their integrals, ``n ln(n / (n - k))`` and ``n (r / (1 - r) + ln(1 - r))``
    with ``r = k / n``. The margin is six standard deviations plus 8; a unit
    that still falls short draws twice as many (the result does not depend
    on the number of draws, only on the first ``k`` distinct values).
    """
    expected = n * math.log(n / (n - k + 0.5))
    r = min(k, n - 0.5) / n
    variance = max(0.0, n * (r / (1 - r) + math.log1p(-r)))
    return int(expected + 6 * math.sqrt(variance)) + 8


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
    dense, plan = split_units(tuple(offsets), tuple(sizes), tuple(ks), tuple(keys), torch.device(device))
    from_draws = None if plan is None else _first_distinct_draws(plan, seed, step, rank)
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


@one_plan_per_layout(budget_args=2)  # ks
def split_units(offsets, sizes, ks, keys, device) -> Tuple[Tuple[bool, ...], Optional["DrawPlan"]]:
    """Which units take ``randperm`` (large, with a budget of a quarter or more), and the plan of the others."""
    dense = tuple(n > _DRAW_LIMIT and 4 * k >= n for n, k in zip(sizes, ks))
    drawn = [u for u, d in enumerate(dense) if not d]
    if not drawn:
        return dense, None
    return dense, draw_plan(tuple(offsets[u] for u in drawn), tuple(sizes[u] for u in drawn),
                            tuple(ks[u] for u in drawn), tuple(keys[u] for u in drawn),
                            tuple(_draws(sizes[u], ks[u]) for u in drawn), device)


class DrawPlan(NamedTuple):
    """Device tensors of one layout of drawn units; only the seeds change from step to step."""

    offsets: Tuple[int, ...]
    sizes: Tuple[int, ...]
    ks: Tuple[int, ...]
    keys: Tuple[int, ...]
    draws: Tuple[int, ...]
    unit: torch.Tensor  # unit of each draw
    stride: torch.Tensor  # j * gamma for the j-th draw of its unit (wrapping int64)
    size: torch.Tensor  # size of the unit of each draw
    offset: torch.Tensor  # offset of the unit of each draw
    first: torch.Tensor  # first draw of each unit
    last: torch.Tensor  # last draw of each unit
    ks_t: torch.Tensor
    keys_t: torch.Tensor


@one_plan_per_layout(budget_args=(2, 4))  # ks and the draws
def draw_plan(offsets, sizes, ks, keys, draws, device) -> DrawPlan:
    """The device tensors of drawn units and their budgets, kept for the layout's last budgets (:mod:`.plans`)."""
    counts = torch.tensor(draws, device=device)
    unit = torch.repeat_interleave(torch.arange(len(sizes), device=device), counts, output_size=sum(draws))
    first = torch.cumsum(counts, 0) - counts
    j = torch.arange(unit.numel(), device=device) - first.index_select(0, unit)
    return DrawPlan(offsets, sizes, ks, keys, draws, unit, j * GAMMA,
                    torch.tensor(sizes, device=device).index_select(0, unit),
                    torch.tensor(offsets, device=device).index_select(0, unit),
                    first, first + counts - 1, torch.tensor(ks, device=device), torch.tensor(keys, device=device))


def _first_distinct_draws(plan: DrawPlan, seed: int, step: int, rank: int) -> torch.Tensor:
    """For each unit, the first ``k_u`` distinct values of ``d_u`` hashed draws."""
    unit_seed = derive_seeds(seed, step, plan.keys_t, rank).index_select(0, plan.unit)
    position = uniform_below(splitmix64_tensor(unit_seed.add_(plan.stride)), plan.size).add_(plan.offset)
    # Units are disjoint, so a value's first draw among all draws is its first in its unit.
    new_value = first_draws(position, max(o + n for o, n in zip(plan.offsets, plan.sizes)))
    distinct = torch.cumsum(new_value, 0)  # distinct values up to each draw, inclusive
    at_first = distinct.index_select(0, plan.first)  # a unit's first draw is always new
    have = distinct.index_select(0, plan.last) - at_first + 1
    short = torch.nonzero(have < plan.ks_t).squeeze(1).tolist()  # a device-to-host sync
    if short:  # very unlikely: those units draw twice as many
        more = list(plan.draws)
        for u in short:
            more[u] = 2 * more[u]
        bigger = draw_plan(plan.offsets, plan.sizes, plan.ks, plan.keys, tuple(more), plan.unit.device)
        return _first_distinct_draws(bigger, seed, step, rank)
    # a new value is kept while its unit has fewer than k_u: distinct < at_first + k_u
    keep = new_value & (distinct < (at_first + plan.ks_t).index_select(0, plan.unit))
    return torch.masked_select(position, keep)


class RandomK(Selector):
    """A uniform k-subset per unit from ``(seed, step, unit, rank)``: recomputable anywhere, so only values travel."""

    name = "randomk"
    code = 1
    leaves_at_random_times = True

    def choose(self, request: SelectionRequest, ks: Tuple[int, ...]) -> torch.Tensor:
        units = request.units
        return random_subsets([u.offset for u in units], [u.numel for u in units], ks, [u.key for u in units],
                              request.seed, request.step, request.rank, request.where)

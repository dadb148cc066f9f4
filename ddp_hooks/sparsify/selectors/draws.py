r"""Counter-based random draws on any device: seeds, uniform k-subsets, first draws, and their plans.

A random selector's choice at a step is a pure function of
``(seed, step, unit, rank)``: every rank can compute every other rank's
choice without communication, a resumed run draws exactly what the
uninterrupted run drew, and the user's ``torch.manual_seed`` stream is never
touched. The mixer is SplitMix64 (Steele, Lea, Flood, 2014), applied to each
input in turn (:func:`derive_seed`), and on the device to many counters at
once (:func:`splitmix64_tensor`).

:func:`random_subsets` draws a uniform ``k_u``-subset of each of many units
at once, with no generator per unit:

1. ``d_u`` draws with replacement, ``x_j = splitmix64(s_u + j * gamma) mod n_u``
   for ``j < d_u``, with ``s_u = derive_seed(seed, step, key_u, rank)`` and
   ``d_u`` a little above the expected number of draws that yields ``k_u``
   distinct values, ``n_u ln(n_u / (n_u - k_u))`` (:func:`draws_needed`);
2. each value's first draw is marked (:func:`first_draws`: a table of first
   draws, or one stable sort; units are disjoint, so a value's first draw
   overall is its first in its unit);
3. each unit keeps the first ``k_u`` distinct values in draw order, each
   written to its own slot of the output, whose size the host knows.

Drawing with replacement and skipping repeats is sequential sampling without
replacement, so the result is exactly a uniform ``k_u``-subset. A unit whose
draws fall short (the margin is six standard deviations plus 8: a chance
below 1e-9) keeps its first ``k_u`` positions instead, a valid subset that
needs no host read to mend, so the draws stay free of host syncs on every
device. A large unit with a budget of a quarter or more of it takes a seeded
``torch.randperm`` of a CPU generator instead, which is cheaper there (copied to
the device without a sync, from pinned memory): every device draws the same.

Plans (the device tensors of one layout of units) are memoised by
:func:`one_plan_per_layout`, one per layout: the plan of the budgets asked
for last. An LRU of ``(layout, budgets)`` would hold the wrong ones during
the density warm-up, whose budgets change at every step.

Example::

    >>> import torch
    >>> derive_seed(0, 5, 3) == derive_seed(0, 5, 3) != derive_seed(0, 6, 3)
    True
    >>> idx = random_subsets([0, 100], [100, 10_000], [5, 50], keys=[3, 4], seed=0, step=7, rank=-1,
    ...                      device=torch.device("cpu"))
    >>> idx.numel(), bool((idx[:5] < 100).all()), bool((idx[5:] >= 100).all()), idx.unique().numel()
    (55, True, True, 55)
    >>> first_draws(torch.tensor([5, 2, 5, 7, 2, 0]), 8).tolist()
    [True, True, False, True, False, True]
"""

from __future__ import annotations

import functools
import math
import threading
from collections import OrderedDict
from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple, TypeVar, Union

import torch

__all__ = ["SHARED", "splitmix64", "derive_seed", "to_signed", "GAMMA", "splitmix64_tensor", "derive_seeds",
           "uniform_below", "generator_for", "one_plan_per_layout", "first_draws", "TABLE_LIMIT", "random_subsets",
           "draws_needed", "split_units", "draw_plan", "DrawPlan"]


# ----- seeds -----
_MASK64 = (1 << 64) - 1

#: Value of ``rank`` for choices shared by all ranks (AllReduce aggregation).
SHARED = -1


def splitmix64(x: int) -> int:
    """One SplitMix64 step of a 64-bit int (Python ints, masked to 64 bits)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def derive_seed(seed: int, step: int, unit: int, rank: int = SHARED) -> int:
    """Return a 64-bit value mixing ``(seed, step, unit, rank)``.

    Args:
        seed (int): the user's seed.
        step (int): the optimizer step (the hook's counter).
        unit (int): the unit of selection: a parameter's key (layer scope), a
            bucket index (bucket scope), or 0 (global scope).
        rank (int): the rank for rank-specific choices, or ``SHARED`` (-1).
    """
    h = splitmix64(seed & _MASK64)
    for part in (step, unit, rank):
        h = splitmix64(h ^ (part & _MASK64))
    return h


def to_signed(x: int) -> int:
    """A 64-bit pattern as the int64 value torch stores for it."""
    return x - (1 << 64) if x >= (1 << 63) else x


#: The SplitMix64 increment as an int64 (the stride between a stream's draws).
GAMMA = to_signed(0x9E3779B97F4A7C15)
_MUL1 = to_signed(0xBF58476D1CE4E5B9)
_MUL2 = to_signed(0x94D049BB133111EB)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's ``>>`` is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def splitmix64_tensor(x: torch.Tensor) -> torch.Tensor:
    """:func:`derive_seed`'s mixer applied elementwise to an int64 tensor (bit patterns, mod 2**64).

    Equal bit for bit to the Python version (``tests/test_sparsify_unit.py``
    checks it), on any device: it is what lets every coordinate of a random
    selection be a pure function of ``(seed, step, unit, rank, counter)``
    computed in a few vectorised integer operations, with no generator per
    unit. Multiplication wraps modulo 2**64, as two's-complement int64 does.

    Example::

        >>> import torch
        >>> x = torch.tensor([0, 1, 2**40])
        >>> splitmix64_tensor(x).tolist() == [to_signed(splitmix64(v)) for v in (0, 1, 2**40)]
        True
    """
    x = x + GAMMA
    shifted = torch.empty_like(x)  # the rounds run in place: two buffers, not one per operation
    for bits, multiplier in ((30, _MUL1), (27, _MUL2), (31, None)):
        torch.bitwise_right_shift(x, bits, out=shifted).bitwise_and_((1 << (64 - bits)) - 1)  # logical shift
        x.bitwise_xor_(shifted)
        if multiplier is not None:
            x.mul_(multiplier)
    return x


def derive_seeds(seed: int, step: int, units: torch.Tensor, rank: int = SHARED) -> torch.Tensor:
    """:func:`derive_seed` for a tensor of unit keys at once, as int64 bit patterns, on ``units.device``.

    Only ``seed`` and ``step`` are mixed on the host; the rest runs on the
    device, so no tensor is copied between host and device.

    Example::

        >>> import torch
        >>> got = derive_seeds(7, 3, torch.tensor([0, 5]), rank=2).tolist()
        >>> got == [to_signed(derive_seed(7, 3, u, 2)) for u in (0, 5)]
        True
    """
    h = splitmix64(splitmix64(seed & _MASK64) ^ (step & _MASK64))
    h = splitmix64_tensor(units ^ to_signed(h))
    return splitmix64_tensor(h ^ to_signed(rank & _MASK64))


def uniform_below(bits: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """Map 64-bit hashes to integers in ``[0, bound)`` (bias below ``bound / 2**63``)."""
    return _shift_right(bits, 1) % bound


def generator_for(seed64: int, device: torch.device = torch.device("cpu")) -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded from a :func:`derive_seed` value.

    Generators of different devices draw different numbers from the same
    seed: the selectors draw on the CPU's, so every device chooses alike.
    """
    gen = torch.Generator(device=device)
    gen.manual_seed(seed64 & ((1 << 63) - 1))
    return gen


# ----- plans, one per layout -----
Plan = TypeVar("Plan")


def one_plan_per_layout(budget_args: Union[int, Tuple[int, ...]], max_layouts: int = 256):
    """Memoise a plan builder of hashable positional arguments, one plan per layout.

    Args:
        budget_args (int or ints): the positions of the arguments that hold
            the budgets (they change from step to step during a warm-up);
            the other arguments make the layout.
        max_layouts (int): layouts remembered, the least recently used
            forgotten first (a model's buckets, times the states in use).

    The memoised function has ``cache_clear()`` and ``held()`` (the plans
    held, least recently used first). Calls from several threads are safe.
    """
    budget_positions = (budget_args,) if isinstance(budget_args, int) else tuple(budget_args)

    def decorate(build: Callable[..., Plan]) -> Callable[..., Plan]:
        plans: "OrderedDict[tuple, Tuple[tuple, Plan]]" = OrderedDict()
        lock = threading.Lock()

        @functools.wraps(build)
        def memoised(*args):
            layout = tuple(a for i, a in enumerate(args) if i not in budget_positions)
            budgets = tuple(args[i] for i in budget_positions)
            with lock:
                held = plans.get(layout)
                if held is not None and held[0] == budgets:
                    plans.move_to_end(layout)
                    return held[1]
                plans.pop(layout, None)  # the old budgets' plan goes before the new one is built
            plan = build(*args)
            with lock:
                plans[layout] = (budgets, plan)
                plans.move_to_end(layout)
                while len(plans) > max_layouts:
                    plans.popitem(last=False)
            return plan

        def cache_clear() -> None:
            with lock:
                plans.clear()

        def held():
            with lock:
                return [plan for _, plan in plans.values()]

        memoised.cache_clear = cache_clear
        memoised.held = held
        return memoised

    return decorate


# ----- first draws -----
#: Largest value range (entries) given a table: 2**22 int32 entries, 16 MiB.
TABLE_LIMIT = 1 << 22
_EMPTY = 2**31 - 1  # larger than any draw index
_tables = threading.local()  # per thread: {device (and stream on a GPU): int32 table}


def first_draws(values: torch.Tensor, value_range: int, use_table: Optional[bool] = None) -> torch.Tensor:
    """Bool per draw: True where ``values[j]`` differs from every earlier ``values[i]``, ``i < j``.

    Two ways, with bitwise the same marks: a stable sort of the values groups
    equal values in draw order, the first of each run marked (``O(d log d)``);
    or an int32 table over ``[0, value_range)``, all ``2**31 - 1`` between
    calls, where ``table[x_j] = min(table[x_j], j)`` over all draws leaves each
    value's first draw, so draw ``j`` is first iff ``table[x_j] == j``, and the
    drawn entries are reset (``O(d)``). The table is kept per thread, device
    and, on a GPU, stream, so that the calls that share it run in order; a
    call that fails drops it rather than leave entries set.

    Args:
        values (Tensor): int64 draws, each in ``[0, value_range)``, 1-D (a
            value outside raises, as any index out of range).
        value_range (int): bound on the values.
        use_table (bool, optional): force the table (True) or the sort
            (False); by default the table when ``value_range <= TABLE_LIMIT``
            and there are fewer than ``2**31 - 1`` draws.
    """
    if use_table is None:
        use_table = value_range <= TABLE_LIMIT and values.numel() < _EMPTY
    if not use_table:
        return _by_sort(values, value_range)
    table = _table(value_range, values.device)
    order = torch.arange(values.numel(), dtype=torch.int32, device=values.device)
    try:
        table.scatter_reduce_(0, values, order, reduce="amin")
        first = table.index_select(0, values) == order
        table.index_fill_(0, values, _EMPTY)  # back to empty for the next call
    except BaseException:
        # a value out of range (or an interrupt) may have left entries set: drop the table, so that no later
        # call reads them; the next call makes a fresh one
        _tables.by_device.pop(_table_key(values.device), None)
        raise
    return first


def _by_sort(values: torch.Tensor, value_range: int) -> torch.Tensor:
    narrow = value_range <= 2**31 - 1  # int32 sorts faster than int64 on the CPU
    grouped, order = torch.sort(values.int() if narrow else values, stable=True)
    first_of_run = torch.ones_like(grouped, dtype=torch.bool)
    torch.ne(grouped[1:], grouped[:-1], out=first_of_run[1:])
    return torch.empty_like(first_of_run).scatter_(0, order, first_of_run)  # back in draw order


def _table(value_range: int, device: torch.device) -> torch.Tensor:
    """This thread's empty table for ``device`` and its current stream, at least ``value_range`` long (a prefix)."""
    tables = getattr(_tables, "by_device", None)
    if tables is None:
        tables = _tables.by_device = {}
    where = _table_key(device)
    table = tables.get(where)
    if table is None or table.numel() < value_range:
        with torch.inference_mode(False):  # made under inference mode, it could not be written outside it
            table = tables[where] = torch.full((value_range,), _EMPTY, dtype=torch.int32, device=device)
    return table[:value_range]


def _table_key(device: torch.device):
    """The device, and on a GPU its current stream: work on one stream is ordered, across streams it is not."""
    if device.type != "cuda":
        return device
    return device, torch.cuda.current_stream(device).cuda_stream


# ----- uniform k-subsets -----
# A unit larger than this whose budget is a quarter of it or more uses randperm.
_DRAW_LIMIT = 1 << 12


def draws_needed(n: int, k: int) -> int:
    """Draws with replacement that give ``k`` distinct values of ``n`` but for a vanishing chance.

    The draws needed, ``D``, have mean ``sum_{i<k} n / (n - i)`` and variance
    ``sum_{i<k} (i / n) / (1 - i / n)**2``; both sums are bounded above by
    their integrals, ``n ln(n / (n - k))`` and ``n (r / (1 - r) + ln(1 - r))``
    with ``r = k / n``. The margin is six standard deviations plus 8; a unit
    that still falls short keeps its first ``k`` positions (module docstring).
    """
    expected = n * math.log(n / (n - k + 0.5))
    r = min(k, n - 0.5) / n
    variance = max(0.0, n * (r / (1 - r) + math.log1p(-r)))
    return int(expected + 6 * math.sqrt(variance)) + 8


def random_subsets(offsets: Sequence[int], sizes: Sequence[int], ks: Sequence[int], keys: Sequence[int],
                   seed: int, step: int, rank: int, device: torch.device,
                   reads_on_host: Optional[bool] = None) -> torch.Tensor:
    """Absolute positions: a uniform ``ks[u]``-subset of each unit, unit by unit (unordered within a unit).

    Args:
        offsets, sizes (ints): each unit's first position and length.
        ks (ints): each unit's budget, ``1 <= ks[u] <= sizes[u]``.
        keys (ints): each unit's key; with ``seed``, ``step`` and ``rank`` it
            gives the unit's seed ``derive_seed(seed, step, key, rank)``.
        device: where the positions are made.
        reads_on_host (bool): whether the number of kept draws may be read on
            the host (default: on the CPU only), which spares the common case
            the writes to slots; the result is the same either way.
    """
    device = torch.device(device)
    dense, plan = split_units(tuple(offsets), tuple(sizes), tuple(ks), tuple(keys), device)
    if reads_on_host is None:
        reads_on_host = device.type == "cpu"
    from_draws = None if plan is None else _first_distinct_draws(plan, seed, step, rank, reads_on_host)
    if not any(dense):
        return from_draws
    parts: List[torch.Tensor] = []
    taken = 0
    for o, n, k, key, d in zip(offsets, sizes, ks, keys, dense):
        if d:
            gen = generator_for(derive_seed(seed, step, key, rank))
            chosen = torch.randperm(n, generator=gen)[:k].add_(o)
            parts.append(chosen if device.type == "cpu" else chosen.pin_memory().to(device, non_blocking=True))
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
                            tuple(draws_needed(sizes[u], ks[u]) for u in drawn), device)


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
    slot_start: torch.Tensor  # per draw: where its unit's k_u values start in the output
    fallback: torch.Tensor  # the output of units that all fell short: each unit's first k_u positions, then a spare


@one_plan_per_layout(budget_args=(2, 4))  # ks and the draws
def draw_plan(offsets, sizes, ks, keys, draws, device) -> DrawPlan:
    """The device tensors of drawn units and their budgets, kept for the layout's last budgets."""
    counts = torch.tensor(draws, device=device)
    unit = torch.repeat_interleave(torch.arange(len(sizes), device=device), counts, output_size=sum(draws))
    first = torch.cumsum(counts, 0) - counts
    j = torch.arange(unit.numel(), device=device) - first.index_select(0, unit)
    ks_t = torch.tensor(ks, device=device)
    slot_start = torch.cumsum(ks_t, 0) - ks_t
    total = sum(ks)
    unit_of_slot = torch.repeat_interleave(torch.arange(len(ks), device=device), ks_t, output_size=total)
    offsets_t = torch.tensor(offsets, device=device)
    fallback = torch.arange(total + 1, device=device)  # (the spare entry receives the draws not kept)
    fallback[:total] += (offsets_t - slot_start).index_select(0, unit_of_slot)
    return DrawPlan(offsets, sizes, ks, keys, draws, unit, j * GAMMA,
                    torch.tensor(sizes, device=device).index_select(0, unit), offsets_t.index_select(0, unit),
                    first, first + counts - 1, ks_t, torch.tensor(keys, device=device),
                    slot_start.index_select(0, unit), fallback)


def _first_distinct_draws(plan: DrawPlan, seed: int, step: int, rank: int, reads_on_host: bool) -> torch.Tensor:
    """For each unit, the first ``k_u`` distinct values of ``d_u`` hashed draws (its first ``k_u`` if it fell short)."""
    unit_seed = derive_seeds(seed, step, plan.keys_t, rank).index_select(0, plan.unit)
    position = uniform_below(splitmix64_tensor(unit_seed.add_(plan.stride)), plan.size).add_(plan.offset)
    # Units are disjoint, so a value's first draw among all draws is its first in its unit.
    new_value = first_draws(position, max(o + n for o, n in zip(plan.offsets, plan.sizes)))
    distinct = torch.cumsum(new_value, 0)  # distinct values up to each draw, inclusive
    at_first = distinct.index_select(0, plan.first)  # a unit's first draw is always new
    # a new value is kept while its unit has fewer than k_u: distinct < at_first + k_u
    kept = new_value & (distinct < (at_first + plan.ks_t).index_select(0, plan.unit))
    total = plan.fallback.numel() - 1
    if reads_on_host:  # where the host may read the count: every unit had its k_u, but for a vanishing chance
        chosen = torch.masked_select(position, kept)
        if chosen.numel() == total:
            return chosen
    # Each kept value goes to its slot among its unit's k_u, so the output's size is the sum of the budgets,
    # known on the host. A unit that fell short (have < k_u) keeps the fallback, its first k_u positions.
    have = distinct.index_select(0, plan.last) - at_first + 1
    kept &= (have >= plan.ks_t).index_select(0, plan.unit)
    slot = (distinct - at_first.index_select(0, plan.unit)).add_(plan.slot_start).masked_fill_(~kept, total)
    return plan.fallback.clone().scatter_(0, slot, position)[:-1]

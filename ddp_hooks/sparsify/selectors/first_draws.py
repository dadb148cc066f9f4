"""Which draws are the first of their value: by one stable sort, or by a table of first draws.

Sequential sampling without replacement (:mod:`.randomk`) keeps, of a
sequence of draws ``x_0, x_1, ...`` in ``[0, R)``, the draws whose value has
not come before. Two ways to mark them, with the same result:

- **sort**: a stable sort of the values groups equal values in draw order;
  the first of each run is a first draw. ``O(d log d)`` for ``d`` draws.
- **table**: an int32 table over ``[0, R)``, all ``2**31 - 1`` between calls.
  ``table[x_j] = min(table[x_j], j)`` over all draws (``scatter_reduce``
  ``"amin"``) leaves at each drawn value its first draw's index, so draw
  ``j`` is first iff ``table[x_j] == j``; the drawn entries are then reset.
  ``O(d)``, with three scattered passes over the draws; the table costs
  ``4 R`` bytes, kept per thread and device and grown on demand. Calls
  from one thread are assumed to run in order on the device (one CUDA
  stream per thread, as DDP's comm hooks do); a call that fails drops the
  table rather than leave entries set.

The table pays where ``d`` is a few thousand to a few hundred thousand and
``R`` is small enough to keep: the blocks of random-block (``R`` = the
bucket's entries over the block size), random-k on small buckets. Past
``TABLE_LIMIT`` values the sort is used, which needs no memory beyond the
draws'. Both give bitwise the same marks (checked in the tests).

Example::

    >>> import torch
    >>> draws = torch.tensor([5, 2, 5, 7, 2, 0])
    >>> first_draws(draws, 8).tolist()
    [True, True, False, True, False, True]
    >>> torch.equal(first_draws(draws, 8), first_draws(draws, 8, use_table=False))
    True
"""

from __future__ import annotations

import threading
from typing import Optional

import torch

__all__ = ["first_draws", "TABLE_LIMIT"]

#: Largest value range (entries) given a table: 2**22 int32 entries, 16 MiB.
TABLE_LIMIT = 1 << 22
_EMPTY = 2**31 - 1  # larger than any draw index
_tables = threading.local()  # per thread: {device: int32 table}; two backward passes never share one


def first_draws(values: torch.Tensor, value_range: int, use_table: Optional[bool] = None) -> torch.Tensor:
    """Bool per draw: True where ``values[j]`` differs from every earlier ``values[i]``, ``i < j``.

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
        _tables.by_device.pop(values.device, None)
        raise
    return first


def _by_sort(values: torch.Tensor, value_range: int) -> torch.Tensor:
    narrow = value_range <= 2**31 - 1  # int32 sorts faster than int64 on the CPU
    grouped, order = torch.sort(values.int() if narrow else values, stable=True)
    first_of_run = torch.ones_like(grouped, dtype=torch.bool)
    torch.ne(grouped[1:], grouped[:-1], out=first_of_run[1:])
    return torch.empty_like(first_of_run).scatter_(0, order, first_of_run)  # back in draw order


def _table(value_range: int, device: torch.device) -> torch.Tensor:
    """This thread's empty table for ``device``, at least ``value_range`` long (a prefix view)."""
    tables = getattr(_tables, "by_device", None)
    if tables is None:
        tables = _tables.by_device = {}
    table = tables.get(device)
    if table is None or table.numel() < value_range:
        with torch.inference_mode(False):  # made under inference mode, it could not be written outside it
            table = tables[device] = torch.full((value_range,), _EMPTY, dtype=torch.int32, device=device)
    return table[:value_range]

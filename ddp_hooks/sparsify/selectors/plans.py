"""A memo for selection plans that keeps one plan per layout: the one of the budgets asked for last.

The random selectors lay out, per bucket, device tensors that depend on the
units (the layout) and on their budgets ``ks``; building them costs a few
small operations per step, so they are memoised. Memoising them by
``(layout, budgets)`` in an LRU of a fixed number of entries holds the
wrong ones during the density warm-up: the budgets change at every step,
no plan is ever asked for twice, and the LRU fills with the plans of the
last 256 steps, each as large as the number of draws. For one 25 MB bucket
of random-block with 4-entry blocks, the plans of 250 warm-up steps held
2.2 GB (GPU memory, when training on a GPU).

:func:`one_plan_per_layout` keeps, for each layout, only the plan of the
budgets asked for last: what a bucket reuses from step to step once the
density has settled, and what the ranks' recomputations within one step
share (AllGather of random selections: every rank's positions are chosen
again from the same plan). Memory is then one plan per bucket layout
whatever the schedule; a warm-up step builds its plan anew, as it did
before. At most ``max_layouts`` layouts are kept, the least recently used
dropped first.

Example::

    >>> built = []
    >>> @one_plan_per_layout(budget_args=1)
    ... def plan(sizes, ks):
    ...     built.append(ks)
    ...     return [n - k for n, k in zip(sizes, ks)]
    >>> plan((10, 20), (1, 2)), plan((10, 20), (1, 2)), plan((10, 20), (3, 4)), plan((10, 20), (1, 2))
    ([9, 18], [9, 18], [7, 16], [9, 18])
    >>> built   # the second call was remembered; (1, 2) was forgotten once (3, 4) came
    [(1, 2), (3, 4), (1, 2)]
    >>> plan.held()
    [[9, 18]]
    >>> plan.cache_clear(); plan.held()
    []
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from typing import Callable, Tuple, TypeVar, Union

__all__ = ["one_plan_per_layout"]

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

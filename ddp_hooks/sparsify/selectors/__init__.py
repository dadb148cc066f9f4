"""Coordinate selectors C_k of the sparsifying hook, one file each, behind one seam.

* ``topk`` (:mod:`.topk`): the k entries of largest magnitude, exact.
* ``randomk`` (:mod:`.randomk`): a uniformly random k-subset.
* ``random_block`` (:mod:`.random_block`): a uniformly random set of blocks
  of ``block_size`` consecutive positions, every coordinate sent with
  probability exactly ``k / n``.
* ``shared_topk`` (:mod:`.shared_topk`): one leader rank's top-k positions
  per unit, rotating over the ranks (small units share one leader per
  step), used by all (AllReduce).

:mod:`.base` says what a selector is and states for the exchange;
:mod:`.registry` lists them. Pure tensor functions, but for shared top-k's
broadcasts of its leaders' positions.
"""

from .base import Choice, SelectionRequest, Selector, Unit, budget, budgets, total_budget
from .registry import (BUILT_IN, register_selector, select, selector_by_code, selector_class, selector_for,
                       selector_names)

__all__ = ["Unit", "budget", "budgets", "total_budget", "SelectionRequest", "Choice", "Selector", "BUILT_IN",
           "register_selector", "select", "selector_by_code", "selector_class", "selector_for", "selector_names"]

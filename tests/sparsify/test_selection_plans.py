"""The random selectors' plans: one per layout, so the density warm-up cannot fill memory with them."""

import threading

import pytest
import torch

from ddp_hooks.sparsify.selectors import Unit, budgets, draws, random_block
from ddp_hooks.sparsify.selectors.draws import one_plan_per_layout
from ddp_hooks.sparsify.selectors.random_block import random_blocks
from ddp_hooks.sparsify.selectors.draws import random_subsets


def test_a_plan_is_reused_for_the_same_budgets_and_replaced_for_new_ones():
    built = []

    @one_plan_per_layout(budget_args=(1, 3))
    def plan(layout, ks, device, draws):
        built.append((layout, ks, draws))
        return object()

    first = plan("a", (1,), "cpu", 5)
    assert plan("a", (1,), "cpu", 5) is first and len(built) == 1
    other_layout = plan("b", (1,), "cpu", 5)  # another bucket: kept beside the first
    assert other_layout is not first and len(plan.held()) == 2
    assert plan("a", (1,), "cpu", 6) is not first  # a budget argument changed: rebuilt, the old plan dropped
    assert len(plan.held()) == 2 and first not in plan.held()
    assert plan("a", (1,), "gpu", 6) is not first and len(plan.held()) == 3  # a non-budget argument: a layout


def test_the_least_recently_used_layout_goes_first():
    @one_plan_per_layout(budget_args=1, max_layouts=2)
    def plan(layout, ks):
        return (layout, ks)

    plan("a", 1), plan("b", 1), plan("a", 1), plan("c", 1)  # "b" is the least recently used
    assert plan.held() == [("a", 1), ("c", 1)]


def test_concurrent_callers_get_plans_of_their_own_arguments():
    @one_plan_per_layout(budget_args=1, max_layouts=4)
    def plan(layout, ks):
        return (layout, ks)

    wrong = []

    def caller(layout):
        for step in range(2000):
            if plan(layout, step % 3) != (layout, step % 3):
                wrong.append(layout)

    threads = [threading.Thread(target=caller, args=(name,)) for name in "abcdef"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong and len(plan.held()) <= 4


def _tensor_bytes(plans):
    return sum(t.numel() * t.element_size() for plan in plans for t in _tensors(plan))


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, tuple):
        for item in value:
            yield from _tensors(item)


@pytest.mark.parametrize("selector", ["random_block", "randomk"])
def test_a_density_warm_up_holds_one_plan_per_layout(selector):
    """Budgets change at every warm-up step; an LRU of (layout, budgets) kept the last 256 steps' plans."""
    memo = random_block.block_plan if selector == "random_block" else draws.draw_plan
    memo.cache_clear()
    if selector == "randomk":
        draws.split_units.cache_clear()
    device = torch.device("cpu")
    layouts = [tuple(Unit(key, 2000 * key, 2000) for key in range(base, base + 8)) for base in (0, 8)]
    for step in range(60):
        density = 0.01 ** (step / 60)
        for units in layouts:
            args = ([u.offset for u in units], [u.numel for u in units], budgets(units, density),
                    [u.key for u in units])
            if selector == "random_block":
                random_blocks(*args, block_size=4, seed=0, step=step, rank=-1, device=device)
            else:
                random_subsets(*args, seed=0, step=step, rank=-1, device=device)
    held = memo.held()
    assert 1 <= len(held) <= len(layouts)
    # what is held is the last step's plans, at density 0.01's few draws: a few kB, not 60 steps' worth
    assert _tensor_bytes(held) < 64 * 1024
    memo.cache_clear()

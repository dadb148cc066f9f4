"""The table of first draws marks exactly what the stable sort marks, leaves itself empty, and is per thread."""

import threading

import pytest
import torch

from ddp_hooks.sparsify.selectors.draws import SHARED
from ddp_hooks.sparsify.selectors import draws as first_draws_module
from ddp_hooks.sparsify.selectors.draws import first_draws
from ddp_hooks.sparsify.selectors.random_block import random_blocks
from ddp_hooks.sparsify.selectors.draws import random_subsets


def _reference(values):
    seen, marks = set(), []
    for v in values.tolist():
        marks.append(v not in seen)
        seen.add(v)
    return marks


@pytest.mark.parametrize("value_range,count", [(1, 5), (10, 200), (1000, 300), (50_000, 20_000)])
def test_table_and_sort_mark_the_first_draw_of_each_value(value_range, count):
    values = torch.randint(0, value_range, (count,), generator=torch.Generator().manual_seed(count))
    by_table = first_draws(values, value_range, use_table=True)
    assert by_table.tolist() == _reference(values)
    assert torch.equal(by_table, first_draws(values, value_range, use_table=False))


def test_the_table_is_empty_after_every_call_and_grows_on_demand():
    first_draws(torch.tensor([3, 1, 3]), 4, use_table=True)
    table = first_draws_module._tables.by_device[torch.device("cpu")]
    assert bool((table == first_draws_module._EMPTY).all())
    assert first_draws(torch.tensor([9, 9, 2]), 10, use_table=True).tolist() == [True, False, True]
    grown = first_draws_module._tables.by_device[torch.device("cpu")]
    assert grown.numel() >= 10 and bool((grown == first_draws_module._EMPTY).all())


def test_threads_keep_their_own_table():
    values = torch.randint(0, 5000, (4000,), generator=torch.Generator().manual_seed(1))
    expected = first_draws(values, 5000, use_table=False)
    results, tables = [], []

    def run():
        for _ in range(20):
            results.append(torch.equal(first_draws(values, 5000, use_table=True), expected))
        tables.append(first_draws_module._tables.by_device[torch.device("cpu")])

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(results) and len(results) == 60
    assert len({t.data_ptr() for t in tables}) == 3


def test_selectors_choose_alike_with_and_without_the_table(monkeypatch):
    cpu = torch.device("cpu")
    subsets = ([0, 3000, 3100], [3000, 100, 5000], [300, 60, 50], [4, 5, 6], 7, 3, SHARED, cpu)
    blocks = ([0, 1000, 9000], [1000, 8000, 333], [10, 80, 4], [1, 2, 3], 4, 11, 5, 0, cpu)
    with_table = random_subsets(*subsets), random_blocks(*blocks)
    monkeypatch.setattr(first_draws_module, "TABLE_LIMIT", 0)  # every call sorts
    assert torch.equal(random_subsets(*subsets), with_table[0])
    assert torch.equal(random_blocks(*blocks), with_table[1])


def test_a_failed_call_leaves_no_stale_entries():
    with pytest.raises((IndexError, RuntimeError)):
        first_draws(torch.tensor([1, 2, 3, 50]), 10, use_table=True)  # 50 is out of range
    assert first_draws(torch.tensor([3, 1]), 4, use_table=True).tolist() == [True, True]
    with pytest.raises((IndexError, RuntimeError)):
        first_draws(torch.tensor([2, -20]), 10, use_table=True)
    assert first_draws(torch.tensor([2, 2, 1]), 4, use_table=True).tolist() == [True, False, True]


def test_a_table_made_under_inference_mode_serves_later_calls():
    first_draws_module._tables.by_device = {}  # this thread's table is made now, inside inference mode
    with torch.inference_mode():
        assert first_draws(torch.tensor([4, 4]), 6, use_table=True).tolist() == [True, False]
    assert first_draws(torch.tensor([5, 0, 5]), 6, use_table=True).tolist() == [True, True, False]


def test_units_need_not_come_in_position_order():
    cpu = torch.device("cpu")
    swapped = random_subsets([100, 0], [50, 100], [5, 10], [1, 2], 3, 4, SHARED, cpu)
    assert bool((swapped[:5] >= 100).all()) and bool((swapped[5:] < 100).all())
    assert swapped[:5].unique().numel() == 5 and swapped[5:].unique().numel() == 10

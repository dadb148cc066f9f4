"""The compressor outside DDP: a flat gradient, its layout and a process group in, the average out."""

import pytest
import torch

from ddp_hooks.sparsify import SparseCompressor, SparsifyOptions
from ddp_hooks.sparsify.selectors import Unit
from ddp_hooks.testing import run_distributed

LAYOUT = ((0, 0, 300), (1, 300, 0), (2, 300, 700))  # three parameters, one of them empty


def _exchanges(rank, world, method, aggregation):
    compressor = SparseCompressor(SparsifyOptions(method=method, aggregation=aggregation, density=0.05))
    generator = torch.Generator().manual_seed(rank)
    given, averages = torch.zeros(1000, dtype=torch.float64), []
    for step in range(5):
        grad = torch.randn(1000, generator=generator)
        given += grad.double()
        averages.append(compressor.exchange(grad, LAYOUT, None, step=step, density=0.05).wait().clone())
        assert averages[-1] is not grad and int((averages[-1] != 0).sum()) <= world * (15 + 35)
    residual = compressor.residuals.flat(0).double()
    return torch.stack(averages), given, residual, compressor.counters.elements_sent


@pytest.mark.parametrize("method,aggregation", [("random_block", "allreduce"), ("topk", "allgather"),
                                                ("randomk", "allgather"), ("shared_topk", "allreduce")])
def test_every_rank_gets_the_same_average_and_no_gradient_is_lost(method, aggregation):
    rows = run_distributed(_exchanges, 2, method, aggregation)
    averages = [r[0] for r in rows]
    assert torch.equal(averages[0], averages[1])
    # what the ranks were given is what they sent (the averages times the world size) plus what they kept
    given = sum(r[1] for r in rows)
    kept = sum(r[2] for r in rows)
    assert torch.allclose(given, 2 * averages[0].double().sum(0) + kept, atol=1e-5)
    assert all(r[3] == 5 * (15 + 35) for r in rows)  # ceil(0.05 * 300) + ceil(0.05 * 700) a step, the empty one none


def _exchanges_in_subgroups(rank, world, method, aggregation):
    """Ranks {0, 2} and {1, 3} each exchange in a group of their own, as the nodes' shards of a hierarchy would."""
    import torch.distributed as dist

    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # (every rank makes every group)
    group = groups[rank % 2]
    compressor = SparseCompressor(SparsifyOptions(method=method, aggregation=aggregation, density=0.05))
    generator = torch.Generator().manual_seed(rank)
    averages, given = [], torch.zeros(1000, dtype=torch.float64)
    for step in range(3):
        grad = torch.randn(1000, generator=generator) + 10.0 * (rank % 2)  # the two groups' gradients differ
        given += grad.double()
        averages.append(compressor.exchange(grad, LAYOUT, group, step=step, density=0.05).wait().clone())
    return torch.stack(averages), given, compressor.residuals.flat(0).double()


@pytest.mark.parametrize("method,aggregation", [("random_block", "allreduce"), ("topk", "allgather"),
                                                ("shared_topk", "allreduce")])
def test_subgroups_exchange_apart(method, aggregation):
    rows = run_distributed(_exchanges_in_subgroups, 4, method, aggregation)
    for members in ((0, 2), (1, 3)):
        a, b = (rows[r] for r in members)
        assert torch.equal(a[0], b[0])  # the same average within a group
        assert torch.allclose(a[1] + b[1], 2 * a[0].double().sum(0) + a[2] + b[2], atol=1e-5)  # nothing lost
    assert not torch.equal(rows[0][0], rows[1][0])  # and the groups apart


def _group_held_after_launch(rank, world):
    compressor = SparseCompressor(SparsifyOptions(method="shared_topk", density=0.05))
    grad = torch.randn(1000)
    units = tuple(Unit(key, offset, n) for key, offset, n in LAYOUT if n)
    pending = compressor.begin(grad, units, torch.tensor([0, 300, 300]), None, key=0, layout=LAYOUT, group=None,
                               step=0, density=0.05)
    held_before = pending.group is not None and pending.request.group is not None
    compressor.send(pending)
    pending.future.wait()
    return held_before, pending.group, pending.request.group


def test_an_exchange_lets_go_of_the_group_once_its_collective_is_launched():
    """Its callbacks may run on gloo's thread: holding the group's last reference there made the group's
    destructor join that very thread, which aborted the process (the compressor's doctest, 7 runs in 15)."""
    for held_before, group, request_group in run_distributed(_group_held_after_launch, 2):
        assert held_before and group is None and request_group is None

"""The compressor outside DDP: a flat gradient, its layout and a process group in, the average out."""

import pytest
import torch

from ddp_hooks.sparsify import SparseCompressor, SparsifyOptions
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

"""The small MLP, its batches, a flattener and every sparsifier combination, shared by the tests (imported by
module name: tests/conftest.py puts tests/ on sys.path)."""

import torch


def small_mlp(seed=0):
    """20-30-40-5 with one Tanh: four parameter tensors, one DDP bucket."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(20, 30), torch.nn.Tanh(), torch.nn.Linear(30, 40), torch.nn.Linear(40, 5))


def batch(rank, step):
    """Rank ``rank``'s inputs at ``step``: a pure function of both."""
    return torch.randn(8, 20, generator=torch.Generator().manual_seed(1000 * step + rank))


def flat(tensors):
    return torch.cat([t.detach().reshape(-1) for t in tensors])


#: Every (method, scope, aggregation) the sparsifier serves.
COMBOS = [("topk", s, "allgather") for s in ("layer", "bucket", "global")] + [
    (m, s, a) for m in ("randomk", "random_block") for s in ("layer", "bucket", "global") for a in ("allreduce", "allgather")
] + [("shared_topk", s, "allreduce") for s in ("layer", "bucket", "global")]

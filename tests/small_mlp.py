"""The small MLP, its batches, a flattener, the hook's remembered update laid out densely, every sparsifier
combination and a net with a layer that forward may leave out, shared by the tests (imported by
module name: tests/conftest.py puts tests/ on sys.path)."""

import torch


def small_mlp(seed=0):
    """20-30-40-5 with one Tanh: four parameter tensors, one DDP bucket."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(20, 30), torch.nn.Tanh(), torch.nn.Linear(30, 40), torch.nn.Linear(40, 5))


class NetWithExtra(torch.nn.Module):
    """Two layers, and a third (`extra`) that forward may leave out (``use_extra``)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.extra = torch.nn.Linear(20, 30), torch.nn.Linear(30, 5), torch.nn.Linear(30, 5)
        self.use_extra = True

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(h) + self.extra(h) if self.use_extra else self.b(h)


def batch(rank, step):
    """Rank ``rank``'s inputs at ``step``: a pure function of both."""
    return torch.randn(8, 20, generator=torch.Generator().manual_seed(1000 * step + rank))


def flat(tensors):
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def last_update_dense(state, model):
    """The sparsify hook's remembered u_t, laid out like the model's parameters (one bucket: these models are
    small)."""
    saved = state.state_dict()["last_updates"]
    parts = []
    for key, p in enumerate(model.parameters()):
        dense = torch.zeros(p.numel())
        if key in saved["positions"]:  # (a position's repeats hold 0: summing keeps its value)
            dense.index_put_((saved["positions"][key],), saved["values"][key], accumulate=True)
        parts.append(dense)
    return torch.cat(parts)


#: Every (method, scope, aggregation) the sparsifier serves.
COMBOS = [("topk", s, "allgather") for s in ("layer", "bucket", "global")] + [
    (m, s, a) for m in ("randomk", "random_block") for s in ("layer", "bucket", "global") for a in ("allreduce", "allgather")
] + [("shared_topk", s, "allreduce") for s in ("layer", "bucket", "global")]

"""The result vectors kept at zero between steps (ddp_hooks.sparsify.memory.SparseOutputs): no stale entry ever reaches .grad.

On the CPU, for float32 buckets without gradient_as_bucket_view, the hook
returns a vector of its own instead of the bucket buffer, and clears only
the positions written at the previous step. A stale value from an earlier
step would show up as an extra non-zero in a gradient; a NaN left behind by a
discarded step would poison the next one.
"""

import math

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_hooks import SparsifyState, sparsify_hook
from ddp_hooks.sparsify.memory import SparseOutput
from ddp_hooks.testing import run_distributed

DENSITY = 0.1


def test_clear_zeroes_what_was_written_or_everything_when_unknown():
    out = SparseOutput(100, torch.device("cpu"))
    out.clear()[torch.tensor([3, 50])] = 7.0
    out.written = [torch.tensor([3, 50])]
    assert not out.clear().any()  # zero_at (a scatter) of the two positions
    out.tensor.fill_(1.0)  # written is None after clear(): unknown, so a full zero follows
    assert not out.clear().any()
    out.tensor[:60] = 2.0
    out.written = [torch.arange(60)]  # over a quarter of the vector: one pass instead
    assert not out.clear().any()


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(40, 30), torch.nn.Linear(30, 10)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _nonzeros_per_step(rank, world, method, aggregation, as_view, nan_at):
    model = DDP(_Net(), bucket_cap_mb=0.002, gradient_as_bucket_view=as_view)
    state = SparsifyState(method=method, density=DENSITY, scope="layer", aggregation=aggregation, density_warmup_steps=0)
    model.register_comm_hook(state, sparsify_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    counts, finite = [], []
    for step in range(6):
        model.zero_grad()
        x = torch.randn(8, 40, generator=torch.Generator().manual_seed(100 * step + rank))
        loss = model(x).pow(2).mean()
        if step == nan_at and rank == 1:
            loss = loss * float("nan")
        loss.backward()
        grads = [p.grad for p in model.parameters()]
        finite.append(all(bool(torch.isfinite(g).all()) for g in grads))
        counts.append([int((g != 0).sum()) for g in grads])
        if finite[-1]:  # skipped like GradScaler skips a non-finite step
            opt.step()
    used = bool(state.results.in_use)
    return counts, finite, used, [p.numel() for p in model.parameters()], torch.cat(
        [p.detach().reshape(-1) for p in model.parameters()])


def test_each_step_holds_only_its_own_positions_and_no_nan_survives_a_discarded_step():
    for method, aggregation in (("random_block", "allreduce"), ("topk", "allgather")):
        runs = {}
        for as_view in (False, True):
            results = run_distributed(_nonzeros_per_step, 2, method, aggregation, as_view, 2)
            counts, finite, used, sizes, params = results[0]
            assert used == (not as_view), "the result vector is used exactly when grads are not bucket views"
            assert finite == [True, True, False, True, True, True], finite  # only the NaN step is non-finite
            budgets = [math.ceil(DENSITY * n) for n in sizes]
            for step, per_param in enumerate(counts):
                if step == 2:
                    continue
                for count, budget in zip(per_param, budgets):
                    if aggregation == "allreduce":  # shared positions: exactly k entries, none left over
                        assert count == budget, (method, as_view, step, per_param, budgets)
                    else:  # each rank's own k: the union holds k to 2k
                        assert budget <= count <= 2 * budget, (method, as_view, step, per_param, budgets)
            runs[as_view] = (counts, params)
        assert runs[False][0] == runs[True][0]
        assert torch.equal(runs[False][1], runs[True][1]), "both result paths must train alike, bit for bit"

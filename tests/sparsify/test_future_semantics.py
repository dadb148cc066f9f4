"""The hook reads what a collective wrote only as PyTorch's CUDA futures allow: after ``wait()``, or in a callback
chained with ``then()`` on that collective's own future.

On a GPU a collective's future completes when the collective is enqueued;
its output is there for a stream that waited (``wait()``, or a ``then()``
callback, which runs on a stream synchronised with it), not for a reader of
``value()`` elsewhere (pytorch#48305). Here every collective of the hook is
replaced by one that behaves so on the CPU: its future is complete at once,
and its output tensor receives the result only when someone waits for it or
chains on it (until then it holds the rank's own values). Training with such
collectives must end bitwise where training with gloo's own ends.
"""

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_hooks import SparsifyState, sparsify_hook
from ddp_hooks.testing import assert_replicas_equal, run_distributed

CONFIGS = [
    dict(method="random_block"),
    dict(method="random_block", scope="global"),
    dict(method="randomk", aggregation="allgather"),  # positions recomputed for every rank
    dict(method="topk", aggregation="allgather", density_warmup_steps=3),  # the crossover to AllReduce, then gathers
    dict(method="shared_topk"),  # broadcasts of the leaders' positions
    dict(method="random_block", warmup_steps=2),  # plain allreduce first
    dict(method="random_block", value_dtype="float16"),
]


class LateFuture(torch.futures.Future):
    """Complete at once, as an enqueued collective's; its output lands only for ``wait()`` or a ``then()`` callback."""

    def __init__(self, land, value):
        super().__init__()
        self._land, self._landed = land, False
        self.set_result(value)

    def landed(self):
        if not self._landed:
            self._landed = True
            self._land()

    def wait(self):
        self.landed()
        return super().wait()

    def then(self, callback):
        def after_landing(fut):
            self.landed()
            return callback(fut)

        return super().then(after_landing)


class LateWork:
    def __init__(self, future):
        self._future = future

    def get_future(self):
        return self._future

    def wait(self, timeout=None):
        self._future.landed()
        return True


def _late_collectives(real):
    """``dist`` collectives that run now into a copy, and write their output when waited for (async_op only)."""
    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if not async_op:
            return real["all_reduce"](tensor, op=op, group=group)
        result = tensor.clone()
        real["all_reduce"](result, op=op, group=group)
        return LateWork(LateFuture(lambda: tensor.copy_(result), [tensor]))

    def all_gather_single(output, tensor, group=None, async_op=False):
        if not async_op:
            return real["all_gather_single"](output, tensor, group=group)
        result = torch.empty_like(output)
        real["all_gather_single"](result, tensor, group=group)
        return LateWork(LateFuture(lambda: output.copy_(result), [output]))

    def broadcast(tensor, src, group=None, async_op=False):
        if not async_op:
            return real["broadcast"](tensor, src, group=group)
        result = tensor.clone()
        real["broadcast"](result, src, group=group)
        return LateWork(LateFuture(lambda: tensor.copy_(result), [tensor]))

    return {"all_reduce": all_reduce, "all_gather_single": all_gather_single, "broadcast": broadcast}


def _train(rank, world, options, late):
    real = {name: getattr(dist, name) for name in ("all_reduce", "all_gather_single", "broadcast")}
    if late:
        for name, function in _late_collectives(real).items():
            setattr(dist, name, function)
    try:
        torch.manual_seed(0)
        model = DDP(torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 5)),
                    bucket_cap_mb=0.004)
        state = SparsifyState(density=0.1, **{"density_warmup_steps": 0, **options})
        model.register_comm_hook(state, sparsify_hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        generator = torch.Generator().manual_seed(rank)
        grads = []
        for _ in range(6):
            x, y = torch.randn(16, 20, generator=generator), torch.randint(0, 5, (16,), generator=generator)
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
            optimizer.step()
        assert_replicas_equal(model.module)
        return torch.stack(grads), torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    finally:
        for name, function in real.items():
            setattr(dist, name, function)


@pytest.mark.parametrize("options", CONFIGS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_outputs_are_read_only_after_waiting_for_them(options):
    on_time = run_distributed(_train, 2, options, False)
    late = run_distributed(_train, 2, options, True)
    for (grads, params), (late_grads, late_params) in zip(on_time, late):
        assert torch.equal(grads, late_grads)
        assert torch.equal(params, late_params)


def _reads_value_without_waiting(rank, world):
    real = {name: getattr(dist, name) for name in ("all_reduce", "all_gather_single", "broadcast")}
    late = _late_collectives(real)["all_reduce"]
    tensor = torch.full((3,), float(rank + 1))
    work = late(tensor, async_op=True)
    early = work.get_future().value()[0].clone()  # what value() alone sees: this rank's own values
    chained = work.get_future().then(lambda fut: fut.value()[0].clone()).wait()
    return early.tolist(), chained.tolist()


def test_late_collectives_hold_back_their_output_from_a_reader_of_value():
    """The emulation itself: ``value()`` alone sees the rank's own values, a chained callback the sum."""
    for rank, (early, chained) in enumerate(run_distributed(_reads_value_without_waiting, 2)):
        assert early == [float(rank + 1)] * 3
        assert chained == [3.0] * 3

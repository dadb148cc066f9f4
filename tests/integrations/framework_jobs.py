"""What the integration tests run on each rank: the same training through plain DDP, Lightning and Accelerate.

Every run trains ``small_mlp`` with plain SGD on the same batches
(``small_mlp.batch(rank, step)``), with top-k at density 0.1 and error
feedback, from the first step; each returns its final weights (flat) and
the hook's stats, so runs can be compared bit for bit.
"""

import os

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_hooks import SparseAverage, SparsifyState, build_local_adaalter, sparsify_hook
from small_mlp import batch, flat, small_mlp

STEPS_PER_EPOCH = 4
LR = 0.1


def new_state():
    return SparsifyState(method="topk", density=0.1, aggregation="allgather", density_warmup_steps=0)


def loss_at(model, rank, step):
    x = batch(rank, step)
    return F.mse_loss(model(x), x[:, :5])


def plain_ddp(rank, world, steps):
    """The reference: the user's own DDP loop with the hook registered by hand."""
    model = DDP(small_mlp())
    state = new_state()
    model.register_comm_hook(state, sparsify_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(steps):
        optimizer.zero_grad()
        loss_at(model, rank, step).backward()
        optimizer.step()
    return flat(model.module.parameters()), state.stats()


def local_adaalter(ddp_model, sparse=False):
    """Local AdaAlter averaging every 2 steps after 1 synchronous step, with DiLoCo's outer optimizer: rounds
    end at steps 3, 5, 7, so a checkpoint after step 4 falls mid-round, where the ranks' weights and
    accumulators differ (and the outer optimizer holds an anchor and a velocity). ``sparse``: the
    synchronisations send pseudo-gradients and accumulators through shared top-k at 0.25, error-fed (each
    rank's residuals differ at every step)."""
    options = dict(sparse=SparseAverage(method="shared_topk", density=0.25), compress_accumulators=True) \
        if sparse else {}
    return build_local_adaalter(ddp_model, lr=0.1, eps=1.0, period=2, warmup_steps=1, outer_lr=0.7,
                                outer_momentum=0.9, **options)


def plain_ddp_local_adaalter(rank, world, steps, sparse=False):
    """The reference: the user's own DDP loop with Local AdaAlter; each rank's weights (they differ)."""
    model = DDP(small_mlp())
    _, optimizer = local_adaalter(model, sparse)
    for step in range(steps):
        optimizer.zero_grad()
        loss_at(model, rank, step).backward()
        optimizer.step()
    return flat(model.module.parameters())


def as_launched_process(rank, world):
    """The environment torchrun gives a process, so that the frameworks join the existing group."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29512"))


def check_against_plain(results, steps):
    """Each rank's (plain DDP, framework, framework resumed) runs: the hook ran at every step, the framework's
    weights are plain DDP's, and the resumed run's are the uninterrupted one's, bit for bit."""
    for (plain_weights, _), (weights, stats), (resumed, resumed_stats) in results:
        assert stats["steps"] == steps  # the hook ran at every step
        assert stats["compressed_steps"] == stats["steps"] and stats["elements_sent"] < stats["elements_dense"] / 5
        assert torch.equal(weights, plain_weights)
        assert torch.equal(resumed, weights)  # every rank's residuals came back from the one saved copy
        assert resumed_stats["steps"] == stats["steps"]

"""Under AllGather, a step whose gather would move more bytes than an AllReduce of everything sends everything."""

import warnings

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_hooks import SparsifyState, sparsify_hook
from ddp_hooks.sparsify.compressor import gather_outweighs_allreduce
from ddp_hooks.testing import assert_replicas_equal, run_distributed
from small_mlp import batch, flat, last_update_dense, small_mlp


@pytest.mark.parametrize("world,value_bytes,index_bytes,below,at", [
    (4, 4, 4, 0.2499, 0.25),  # top-k, float32 values and int32 positions: from 1/w
    (8, 4, 4, 0.1249, 0.125),
    (4, 4, 0, 0.4999, 0.5),  # random-k under AllGather, values only: from 2/w
    (2, 4, 0, 0.9999, 1.0),
    (4, 2, 4, 0.1666, 0.1667),  # half-precision values with int32 positions: 2*2 / (4*6)
    (1, 4, 4, 0.9999, 1.0),  # one rank: only where every entry is sent anyway
])
def test_the_crossover_density(world, value_bytes, index_bytes, below, at):
    assert not gather_outweighs_allreduce(below, world, value_bytes, index_bytes)
    assert gather_outweighs_allreduce(at, world, value_bytes, index_bytes)


def _through_the_warmup(rank, world):
    # density 1, 0.46, 0.22, 0.1, 0.046, 0.022, then 0.01: at 4 ranks the first two steps are at or above 1/4
    state = SparsifyState(method="topk", aggregation="allgather", density=0.01, density_warmup_steps=6)
    model = DDP(small_mlp())
    model.register_comm_hook(state, sparsify_hook)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    numel = sum(p.numel() for p in params)
    rows = []
    for step in range(8):
        before = state.stats()["bytes_sent"]
        opt.zero_grad()
        model(batch(rank, step)).pow(2).mean().backward()
        opt.step()
        buf = flat(opt.state[p]["momentum_buffer"] for p in params)
        u = last_update_dense(state, model.module)
        residual = torch.cat([state.residual_for(p).reshape(-1) for p in params])
        rows.append({"bytes": state.stats()["bytes_sent"] - before, "density": state.density_at(step),
                     "buffer_error": float((buf - u).abs().max() / u.abs().max()),
                     "residual_zero": bool((residual == 0).all()), "sent_fraction": float((u != 0).float().mean())})
    assert_replicas_equal(model.module)
    return numel, rows


def test_top_k_sends_everything_by_allreduce_while_the_gather_would_cost_more():
    numel, rows = run_distributed(_through_the_warmup, 4, timeout=300)[0]
    for row in rows:
        # the optimizer's buffer is u_t on either path, and across the change of path
        assert row["buffer_error"] < 1e-5, row
        if row["density"] >= 0.25:
            assert row["bytes"] == numel * 4, row  # every entry, float32, no positions
            assert row["residual_zero"] and row["sent_fraction"] == 1.0, row
        else:
            assert row["bytes"] < numel * 4 * row["density"] * 2 + 4 * 8, row  # k values and k int32 positions
            assert not row["residual_zero"], row
    assert sum(row["density"] >= 0.25 for row in rows) == 2


def _against_dense(rank, world, density):
    def train(hook, state):
        model = DDP(small_mlp())
        model.register_comm_hook(state, hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        for step in range(5):
            opt.zero_grad()
            model(batch(rank, step)).pow(2).mean().backward()
            opt.step()
        return flat(p.detach() for p in model.parameters())

    dense = train(allreduce_hook, None)
    state = SparsifyState(method="topk", aggregation="allgather", density=density, density_warmup_steps=0)
    return float((train(sparsify_hook, state) - dense).abs().max())


def test_above_the_crossover_top_k_trains_as_the_allreduce_hook():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        above = run_distributed(_against_dense, 4, 0.3, timeout=300)[0]
        below = run_distributed(_against_dense, 4, 0.2, timeout=300)[0]
    assert above < 1e-6  # the mean of g + e with e = 0: the dense average, up to the collective's rounding
    assert below > 1e-4  # a sparse exchange leaves most entries for later

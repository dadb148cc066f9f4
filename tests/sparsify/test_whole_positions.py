"""A step that sends every entry runs copies instead of gathers and scatters (ddp_hooks.sparsify.positions): bit for bit
the indexed path's result."""

import warnings
import weakref

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_hooks import SparsifyState, sparsify_hook
from ddp_hooks.sparsify import memory as positions
from ddp_hooks.testing import run_distributed
from small_mlp import NetWithExtra


@pytest.mark.parametrize("numel", [1, 7, 1000])
def test_each_operation_equals_its_indexed_form_at_every_position(numel):
    torch.manual_seed(numel)
    source, values = torch.randn(numel), torch.randn(numel)
    every = torch.arange(numel)
    assert torch.equal(positions.gather(source, every, whole=True), positions.gather(source, every, whole=False))
    assert positions.gather(source, every, whole=True) is source  # read in place, not copied
    assert torch.equal(positions.put(torch.randn(numel), every, values, whole=True),
                       positions.put(torch.randn(numel), every, values, whole=False))
    assert not positions.zero_at(torch.randn(numel), every, whole=True).any()
    assert not positions.zero_at(torch.randn(numel), every, whole=False).any()
    # parameters of no entries among them, at the start, inside and at the end
    sizes = [0, numel // 3, 0, numel - numel // 3, 0]
    starts = torch.tensor([sum(sizes[:i]) for i in range(len(sizes))])
    assert torch.equal(positions.owners(starts, every, numel, whole=True),
                       positions.owners(starts, every, numel, whole=False))


def test_every_position_is_one_tensor_while_held():
    held = positions.every_position(10, torch.device("cpu"))
    assert held.tolist() == list(range(10))
    assert positions.every_position(10, torch.device("cpu")) is held
    assert positions.every_position(11, torch.device("cpu")).numel() == 11
    alive = weakref.ref(held)
    del held
    assert alive() is None  # the shared tensor is not kept once no step holds it
    assert positions.every_position(10, torch.device("cpu")).tolist() == list(range(10))


def _indexed_only(patched):
    """Make every operation of the hook take its indexed path, whatever the step says.

    A step that sends everything still selects every position in order, but
    its exchange is told it is not whole: every later stage indexes.
    """
    from ddp_hooks.sparsify.compressor import SparseCompressor

    original = SparseCompressor.begin

    def begin(self, *args, **kwargs):
        pending = original(self, *args, **kwargs)
        pending.dense = False
        return pending

    patched.append((SparseCompressor, "begin", original))
    SparseCompressor.begin = begin


def _train(rank, config, indexed):
    patched = []
    if indexed:
        _indexed_only(patched)
    try:
        model = DDP(NetWithExtra(), bucket_cap_mb=0.002, find_unused_parameters=True)
        if config == "topk-crossover":  # 4 ranks: densities 1 and 0.46 are sent whole (>= 1/4), then indexed
            state = SparsifyState(method="topk", aggregation="allgather", density=0.01, density_warmup_steps=6)
        else:  # the hook's own momentum and weight decay: its warm-up steps send everything
            state = SparsifyState(method="random_block", density=0.1, momentum=0.9, weight_decay=5e-4,
                                  warmup_steps=3)
        model.register_comm_hook(state, sparsify_hook)
        net = model.module
        if config == "topk-crossover":  # two groups of different momentum: one momentum per parameter
            opt = torch.optim.SGD([{"params": list(net.a.parameters()) + list(net.extra.parameters())},
                                   {"params": net.b.parameters(), "momentum": 0.5}],
                                  lr=0.05, momentum=0.9, weight_decay=5e-4)
        else:
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in range(6):
            net.use_extra = step % 2 == 0
            opt.zero_grad()
            x = torch.randn(8, 20, generator=torch.Generator().manual_seed(100 * step + rank))
            model(x).pow(2).mean().backward()
            opt.step()
        params = list(model.parameters())
        return {
            "params": torch.cat([p.detach().reshape(-1) for p in params]),
            "residuals": torch.cat([state.residual_for(p).reshape(-1) for p in params]),
            "velocities": torch.cat([state.velocity_for(p).reshape(-1) for p in params]),
            "buffers": torch.cat([opt.state[p]["momentum_buffer"].reshape(-1) for p in params
                                  if "momentum_buffer" in opt.state[p]] or [torch.zeros(0)]),
            "last_updates": state.state_dict()["last_updates"],
        }
    finally:
        for module, name, original in reversed(patched):
            setattr(module, name, original)


def _both(rank, world, config):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _train(rank, config, indexed=False), _train(rank, config, indexed=True)


@pytest.mark.parametrize("config,world", [("topk-crossover", 4), ("hook-momentum-warmup", 2)])
def test_steps_sent_whole_equal_the_indexed_path_bit_for_bit(config, world):
    for fast, indexed in run_distributed(_both, world, config, timeout=300):
        for name in ("params", "residuals", "velocities", "buffers"):
            assert torch.equal(fast[name], indexed[name]), name
        for part in ("positions", "values"):
            assert fast["last_updates"][part].keys() == indexed["last_updates"][part].keys()
            for key in fast["last_updates"][part]:
                assert torch.equal(fast["last_updates"][part][key], indexed["last_updates"][part][key]), (part, key)
        assert fast["residuals"].abs().sum() > 0  # the run ended past its whole steps, with something held back

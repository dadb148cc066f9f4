"""DDP's modes with both hooks (2 gloo ranks): each works, checked against a plain run, or is refused clearly.

Modes: gradient_as_bucket_view, static_graph (buckets rebuilt at the 2nd
iteration), find_unused_parameters with a parameter unused in some steps (on
every rank, or on one), no_sync() gradient accumulation, half-precision
gradients, and PyTorch's fp16_compress_wrapper.
"""

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook, fp16_compress_wrapper
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_hooks import LocalAdaAlter, LocalSGDState, SparsifyState, build_local_adaalter, local_sgd_hook, sparsify_hook
from ddp_hooks.testing import assert_replicas_equal, run_distributed
from small_mlp import NetWithExtra as Net

SPARSIFY = [("random_block", "layer", "allreduce"), ("topk", "global", "allgather"), ("randomk", "bucket", "allgather")]


def _batch(rank, step, n=8):
    return torch.randn(n, 20, generator=torch.Generator().manual_seed(1000 * step + rank))


def _flat(tensors):
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def _train(rank, hook, state, steps=4, **ddp_kwargs):
    model = DDP(Net(), bucket_cap_mb=0.002, **ddp_kwargs)
    model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        opt.zero_grad()
        model(_batch(rank, step)).pow(2).mean().backward()
        opt.step()
    assert_replicas_equal(model)
    return _flat(model.parameters())


def _sparsify_train(rank, combo, **ddp_kwargs):
    method, scope, aggregation = combo
    state = SparsifyState(method=method, scope=scope, aggregation=aggregation, density=0.1, density_warmup_steps=0)
    return _train(rank, sparsify_hook, state, **ddp_kwargs)


class NetWithEmpty(Net):
    """Net with a zero-size parameter between its layers (DDP buckets it like any other)."""

    def __init__(self):
        super().__init__()
        self.empty = torch.nn.Parameter(torch.zeros(0, 30))

    def forward(self, x):
        return super().forward(x) + self.empty.sum()


def _mass_error(rank, world, combo, unused_at=None, steps=9, net_class=Net, **ddp_kwargs):
    """max |applied gradients + mean residual - mean true gradients| over `steps` steps, parameters held fixed.

    unused_at(step) -> the ranks that leave `extra` out at that step.
    """
    method, scope, aggregation = combo
    net, ref = net_class(), net_class()
    model = DDP(net, bucket_cap_mb=0.002, **ddp_kwargs)
    state = SparsifyState(method=method, scope=scope, aggregation=aggregation, density=0.1, density_warmup_steps=0)
    model.register_comm_hook(state, sparsify_hook)
    applied = torch.zeros(sum(p.numel() for p in net.parameters()), dtype=torch.float64)
    true_sum = torch.zeros_like(applied)
    for step in range(steps):
        net.use_extra = ref.use_extra = unused_at is None or rank not in unused_at(step)
        x = _batch(rank, step)
        model.zero_grad(set_to_none=True)
        model(x).pow(2).sum().backward()
        # DDP leaves .grad alone (None here) for a parameter no rank used: what the hook sent for it is dropped
        applied += _flat(p.grad if p.grad is not None else torch.zeros_like(p) for p in net.parameters()).double()
        ref.zero_grad(set_to_none=True)
        ref(x).pow(2).sum().backward()
        g = _flat(p.grad if p.grad is not None else torch.zeros_like(p) for p in ref.parameters()).double()
        dist.all_reduce(g)
        true_sum += g / world
    e = _flat(state.residual_for(p) for p in net.parameters()).double()
    dist.all_reduce(e)
    return (applied + e / world - true_sum).abs().max().item()


def _sparsify_modes(rank, world):
    out = {}
    for combo in SPARSIFY:
        plain = _sparsify_train(rank, combo)
        out[("bucket_view", combo)] = torch.equal(plain, _sparsify_train(rank, combo, gradient_as_bucket_view=True))
        out[("static_graph", combo)] = _mass_error(rank, world, combo, static_graph=True)
        # `extra` unused on every rank at steps 1, 4, 7 and on rank 1 only at steps 2, 5, 8
        out[("unused", combo)] = _mass_error(rank, world, combo, find_unused_parameters=True,
                                             unused_at=lambda s: {0: (), 1: (0, 1), 2: (1,)}[s % 3])
    out["no_sync"] = _no_sync(rank)
    out["half_odd_k"] = _half_topk_odd_k(rank)
    out["fp16_wrapper"] = _fp16_wrapper(rank)
    return out


def _no_sync(rank):
    """Two micro-batches (the first under no_sync) vs one backward of both losses: the same step."""
    results = []
    for accumulate in (True, False):
        model = DDP(Net(), bucket_cap_mb=0.002)
        state = SparsifyState(method="topk", aggregation="allgather", density=0.1)
        model.register_comm_hook(state, sparsify_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in range(3):
            opt.zero_grad()
            first, second = _batch(rank, 2 * step), _batch(rank, 2 * step + 1)
            if accumulate:
                with model.no_sync():
                    model(first).pow(2).mean().backward()
                model(second).pow(2).mean().backward()
            else:
                (model(first).pow(2).mean() + model(second).pow(2).mean()).backward()
            opt.step()
        assert state.stats()["steps"] == 3  # the hook ran on the synchronised backward only
        results.append(_flat(model.parameters()))
    return (results[0] - results[1]).abs().max().item()


def _half_topk_odd_k(rank):
    """Top-k allgather of fp16/bf16 gradients with an odd number of entries per rank (2 + 1 here)."""
    ok = []
    for dtype in (torch.float16, torch.bfloat16):
        torch.manual_seed(0)
        model = DDP(torch.nn.Linear(5, 1).to(dtype))
        model.register_comm_hook(SparsifyState(method="topk", aggregation="allgather", density=0.3), sparsify_hook)
        for step in range(2):
            model.zero_grad()
            model(_batch(rank, step)[:, :5].to(dtype)).float().sum().backward()
        ok.append(all(torch.isfinite(p.grad.float()).all() for p in model.parameters()))
        assert_replicas_equal(model)
    return all(ok)


def _fp16_wrapper(rank):
    """fp16_compress_wrapper(sparsify_hook): at density 1 PyTorch's fp16_compress_hook bit for bit; at 0.1 it runs."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dense = SparsifyState(density=1.0, density_warmup_steps=0, optimizer_momentum="steps")
    sparse = SparsifyState(method="topk", aggregation="allgather", density=0.1, density_warmup_steps=0)
    same = torch.equal(_train(rank, fp16_compress_hook, None), _train(rank, fp16_compress_wrapper(sparsify_hook), dense))
    _train(rank, fp16_compress_wrapper(sparsify_hook), sparse)
    return same and all(t.dtype == torch.float32 for t in sparse.residuals.state().values())


def test_sparsify_hook_under_every_ddp_mode():
    results = run_distributed(_sparsify_modes, 2, timeout=300)
    for out in results:
        for combo in SPARSIFY:
            assert out[("bucket_view", combo)], combo  # bit for bit the run without bucket views
            # mass conserved across static_graph's rebuild, and with parameters unused on some or all ranks
            assert out[("static_graph", combo)] < 1e-4, (combo, out[("static_graph", combo)])
            assert out[("unused", combo)] < 1e-4, (combo, out[("unused", combo)])
        assert out["no_sync"] < 1e-6, out["no_sync"]
        assert out["half_odd_k"]
        assert out["fp16_wrapper"]


ALL_COMBOS = [(method, scope, "allgather" if method == "topk" else "allreduce")
              for method in ("topk", "randomk", "random_block", "shared_topk") for scope in ("layer", "bucket", "global")]


def _empty_parameter(rank, world):
    return {combo: _mass_error(rank, world, combo, steps=4, net_class=NetWithEmpty) for combo in ALL_COMBOS}


def test_sparsify_hook_with_an_empty_parameter():
    """A zero-size parameter gets no budget and breaks nothing: mass is conserved in every method and scope."""
    for out in run_distributed(_empty_parameter, 2, timeout=300):
        for combo, error in out.items():
            assert error < 1e-4, (combo, error)


def _local_sgd_train(rank, steps=6, accumulate=False, dtype=torch.float32, **ddp_kwargs):
    model = DDP(Net().to(dtype), **ddp_kwargs)
    _, opt = build_local_adaalter(model, lr=0.3, eps=1.0, period=2, warmup_steps=2)
    for step in range(steps):
        opt.zero_grad()
        x = _batch(rank, step).to(dtype)
        if accumulate:  # the first half of the batch under no_sync: the same gradient sum
            with model.no_sync():
                model(x[:4]).pow(2).sum().div(40).backward()
            model(x[4:]).pow(2).sum().div(40).backward()
        else:
            model(x).pow(2).sum().div(40).backward()
        opt.step()
    assert opt.schedule.last_sync == steps  # the run ends on an averaging: replicas agree
    assert_replicas_equal(model)
    return _flat(model.parameters())


def _local_sgd_modes(rank, world):
    out = {}
    plain = _local_sgd_train(rank)
    for name, kwargs in (("bucket_view", dict(gradient_as_bucket_view=True)), ("static_graph", dict(static_graph=True))):
        out[name] = torch.equal(plain, _local_sgd_train(rank, **kwargs))
    out["no_sync"] = (plain - _local_sgd_train(rank, accumulate=True)).abs().max().item()
    out["bf16"] = bool(torch.isfinite(_local_sgd_train(rank, dtype=torch.bfloat16).float()).all())
    try:
        LocalAdaAlter(Net().half().parameters())
    except TypeError as exc:
        out["fp16"] = str(exc)
    model = DDP(Net())
    model.register_comm_hook(LocalSGDState(warmup_steps=1), fp16_compress_wrapper(local_sgd_hook))
    try:
        model(_batch(rank, 0)).sum().backward()
    except TypeError as exc:
        out["fp16_wrapper"] = str(exc)
    return out


def test_local_sgd_hook_under_ddp_modes():
    for out in run_distributed(_local_sgd_modes, 2, timeout=120):
        assert out["bucket_view"] and out["static_graph"]
        assert out["no_sync"] < 1e-5, out["no_sync"]
        assert out["bf16"]
        assert "LocalAdaAlter got a float16 parameter" in out["fp16"]
        assert out["fp16_wrapper"].startswith("local_sgd_hook received a torch.float16 bucket for ['torch.float32'] "
                                              "parameters: a wrapper such as fp16_compress_wrapper cast it")

"""Multi-process checks of sparsify_hook on gloo: invariants, mass, parity, resume."""

import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_hooks import SparsifyState, sparsify_hook
from ddp_hooks.sparsify.selectors import budget
from ddp_hooks.testing import assert_replicas_equal, run_distributed
from small_mlp import COMBOS, batch, small_mlp

def _recording_hook(rec, bucket):
    for p, g in zip(bucket.parameters(), bucket.gradients()):
        rec["g"][id(p)] = g.detach().clone()
        rec["bucket_of"][id(p)] = bucket.index()
    return sparsify_hook(rec["state"], bucket)


def _residual_by_param(state, params):
    return {id(p): state.residual_for(p) for p in params}


def _check_invariants(rank, world, method, scope, aggregation, density, steps=3):
    state = SparsifyState(method=method, density=density, scope=scope, aggregation=aggregation, seed=7, density_warmup_steps=0)
    model = DDP(small_mlp(), bucket_cap_mb=0.002)  # several buckets after the rebuild
    rec = {"state": state, "g": {}, "bucket_of": {}}
    model.register_comm_hook(rec, _recording_hook)
    params = list(model.parameters())
    for step in range(steps):
        e_old = _residual_by_param(state, params)
        model.zero_grad()
        model(batch(rank, step)).pow(2).sum().backward()
        e_new = _residual_by_param(state, params)
        sent = {id(p): rec["g"][id(p)].reshape(p.shape) + e_old[id(p)] - e_new[id(p)] for p in params}
        comp = {id(p): rec["g"][id(p)].reshape(p.shape) + e_old[id(p)] for p in params}
        # sent + new residual == compensated input, and sent entries are taken whole
        for p in params:
            mask = sent[id(p)] != 0
            assert torch.equal(sent[id(p)][mask], comp[id(p)][mask])
            assert torch.all(e_new[id(p)][mask] == 0)
        # exactly the budgeted number of coordinates
        if scope == "layer":
            for p in params:
                assert int((sent[id(p)] != 0).sum()) == budget(p.numel(), density), (method, scope, p.shape)
        elif scope == "bucket":
            for b in set(rec["bucket_of"].values()):
                members = [p for p in params if rec["bucket_of"][id(p)] == b]
                nnz = sum(int((sent[id(p)] != 0).sum()) for p in members)
                assert nnz == budget(sum(p.numel() for p in members), density)
        else:
            nnz = sum(int((sent[id(p)] != 0).sum()) for p in params)
            assert nnz == budget(sum(p.numel() for p in params), density)
        flat_sent = torch.cat([sent[id(p)].reshape(-1) for p in params])
        rows = [torch.empty_like(flat_sent) for _ in range(world)]
        dist.all_gather(rows, flat_sent)
        masks = [r != 0 for r in rows]
        same = all(torch.equal(m, masks[0]) for m in masks)
        if aggregation == "allreduce":
            assert same, "allreduce aggregation must choose the same coordinates on every rank"
        elif world > 1 and method != "topk":
            assert not same, "allgather random selectors must choose rank-specific coordinates"
        # the applied gradient is the mean of what the ranks sent
        mean = torch.stack(rows).sum(0) / world
        grads = torch.cat([p.grad.reshape(-1) for p in params])
        torch.testing.assert_close(grads, mean, rtol=1e-5, atol=1e-6)
    stats = state.stats()
    assert stats["steps"] == steps and stats["bytes_sent"] < stats["bytes_dense"]


def _all_invariants(rank, world):
    for method, scope, aggregation in COMBOS:
        _check_invariants(rank, world, method, scope, aggregation, density=0.1)
    return True


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_invariants_every_method_scope_and_aggregation(world_size):
    assert run_distributed(_all_invariants, world_size, timeout=300) == [True] * world_size


def _mass(rank, world, steps=12):
    out = []
    for method, scope, aggregation in COMBOS:
        state = SparsifyState(method=method, density=0.05, scope=scope, aggregation=aggregation, density_warmup_steps=0)
        model = DDP(small_mlp(), bucket_cap_mb=0.002)
        model.register_comm_hook(state, sparsify_hook)
        applied = torch.zeros(sum(p.numel() for p in model.parameters()), dtype=torch.float64)
        true_sum = torch.zeros_like(applied)
        ref = small_mlp()
        for step in range(steps):
            x = batch(rank, step)
            model.zero_grad()
            model(x).pow(2).sum().backward()
            applied += torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double()
            ref.zero_grad()
            ref(x).pow(2).sum().backward()
            g = torch.cat([p.grad.reshape(-1) for p in ref.parameters()]).double()
            dist.all_reduce(g)
            true_sum += g / world
        res = _residual_by_param(state, list(model.parameters()))
        e = torch.cat([res[id(p)].reshape(-1) for p in model.parameters()]).double()
        dist.all_reduce(e)
        err = (applied + e / world - true_sum).abs().max().item()
        out.append((method, scope, aggregation, err, e.abs().sum().item()))
    return out


def test_mass_is_conserved_across_steps_and_the_bucket_rebuild():
    for method, scope, aggregation, err, residual_mass in run_distributed(_mass, 2, timeout=300)[0]:
        assert residual_mass > 0, "a residual must remain at density 0.05"
        assert err < 1e-4, (method, scope, aggregation, err)


def _train(rank, world, hook, state, steps, momentum=0.9):
    model = DDP(small_mlp(), bucket_cap_mb=0.002)
    model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum)
    for step in range(steps):
        opt.zero_grad()
        model(batch(rank, step)).pow(2).mean().backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _parity(rank, world):
    dense = _train(rank, world, allreduce_hook, None, 6)
    diffs = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for method, scope, aggregation in COMBOS:
            # the optimizer's momentum as is: the path that is the allreduce hook bit for bit at density 1
            st = SparsifyState(method=method, density=1.0, scope=scope, aggregation=aggregation,
                               density_warmup_steps=0, optimizer_momentum="steps")
            diffs[(method, scope, aggregation)] = (_train(rank, world, sparsify_hook, st, 6) - dense).abs().max().item()
    return diffs


@pytest.mark.parametrize("world_size", [2, 3])
def test_density_one_equals_the_allreduce_hook(world_size):
    for combo, diff in run_distributed(_parity, world_size, timeout=300)[0].items():
        if combo[2] == "allreduce" and combo[1] != "global":
            assert diff == 0.0, (combo, diff)  # same values, same collective: bit for bit
        else:
            # allgather sums ranks in index_add_ order; global scope reduces all
            # buckets in one collective, which gloo chunks differently
            assert diff < 1e-6, (combo, diff)


def _resume(rank, world, tmp, method, scope, aggregation, warmup=0, momentum_in_hook=False, value_dtype=None, n=3):
    def build():
        model = DDP(small_mlp(), bucket_cap_mb=0.002)
        options = dict(method=method, density=0.1, scope=scope, aggregation=aggregation, seed=3, warmup_steps=warmup,
                       value_dtype=value_dtype)
        if momentum_in_hook:  # velocities in the hook state, plain SGD
            st = SparsifyState(momentum=0.9, weight_decay=5e-4, **options)
            model.register_comm_hook(st, sparsify_hook)
            return model, torch.optim.SGD(model.parameters(), lr=0.05), st
        st = SparsifyState(**options, density_warmup_steps=0)
        model.register_comm_hook(st, sparsify_hook)
        return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), st

    def run(model, opt, start, stop):
        for step in range(start, stop):
            opt.zero_grad()
            model(batch(rank, step)).pow(2).mean().backward()
            opt.step()

    model, opt, st = build()
    run(model, opt, 0, 2 * n)
    straight = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    model, opt, st = build()
    run(model, opt, 0, n)
    path = f"{tmp}/ckpt_rank{rank}.pt"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "hook": st.state_dict()}, path)
    assert bool(st.state_dict()["velocities"]) == (momentum_in_hook or st.counts_momentum_in_sends)
    model, opt, st = build()
    ck = torch.load(path, weights_only=True)
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["opt"])
    st.load_state_dict(ck["hook"])
    run(model, opt, n, 2 * n)
    resumed = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert st.step == 2 * n
    return torch.equal(straight, resumed)


@pytest.mark.parametrize("method,scope,aggregation,warmup,momentum_in_hook,value_dtype", [
    ("random_block", "layer", "allreduce", 0, False, None), ("randomk", "layer", "allgather", 0, False, None),
    ("topk", "layer", "allgather", 0, False, None), ("topk", "global", "allgather", 0, False, None),
    ("random_block", "layer", "allreduce", 2, False, None),  # keys must not depend on when compression starts
    # velocities (SparsifyState(momentum=...)) follow the same path as residuals
    ("randomk", "layer", "allgather", 0, True, None), ("random_block", "layer", "allreduce", 2, True, None),
    ("topk", "global", "allgather", 0, True, None),
    ("shared_topk", "layer", "allreduce", 0, False, None), ("shared_topk", "global", "allreduce", 0, True, None),
    # float16 values: the rounding kept in the residual is state like the rest
    ("random_block", "layer", "allreduce", 0, False, "float16"), ("topk", "layer", "allgather", 0, True, "float16"),
])
def test_checkpoint_resume_is_exact(tmp_path, method, scope, aggregation, warmup, momentum_in_hook, value_dtype):
    assert run_distributed(_resume, 2, str(tmp_path), method, scope, aggregation, warmup,
                           momentum_in_hook, value_dtype) == [True, True]


def _mismatch(rank, world):
    density = 0.1 if rank == 0 else 0.2
    model = DDP(small_mlp())
    model.register_comm_hook(SparsifyState(density=density, density_warmup_steps=0), sparsify_hook)
    model(batch(rank, 0)).sum().backward()


def test_ranks_with_different_options_all_raise_the_same_error():
    with pytest.raises(ValueError, match="ranks were built with different SparsifyState options"):
        run_distributed(_mismatch, 2, timeout=60)


def _wrong_world(rank, world, sd):
    st = SparsifyState()
    st.load_state_dict(sd)
    model = DDP(small_mlp())
    model.register_comm_hook(st, sparsify_hook)
    model(batch(rank, 0)).sum().backward()


def test_state_saved_on_another_world_size_is_refused():
    sd = SparsifyState().state_dict()
    sd["world_size"] = 4
    with pytest.raises(ValueError, match="saved on 4 ranks but this run has 2"):
        run_distributed(_wrong_world, 2, sd, timeout=60)


def _foreign_state(rank, world, kind):
    """Load a hook state that does not belong here; return the error at the first backward."""
    def trained(module, r):
        model = DDP(module)
        st = SparsifyState(density=0.1)
        model.register_comm_hook(st, sparsify_hook)
        model(torch.randn(4, module[0].in_features, generator=torch.Generator().manual_seed(r))).sum().backward()
        return st.state_dict()

    # All parameters of `small` and `big` have 16 elements, so whatever order DDP hands them
    # over in, the two models share their first parameter numbers and shapes.
    small = lambda: torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False))  # noqa: E731
    big = lambda: torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 4, bias=False))  # noqa
    sd = trained({"rank": small_mlp, "fewer_params": big}.get(kind, small)(), rank)
    if kind == "rank":  # the other rank's file
        rows = [None] * world
        torch.distributed.all_gather_object(rows, sd)
        sd = rows[1 - rank]
    target = {"rank": small_mlp, "fewer_params": small, "more_params": big,
              "other_shape": lambda: torch.nn.Sequential(torch.nn.Linear(4, 5, bias=False))}[kind]()
    st = SparsifyState(density=0.1)
    st.load_state_dict(sd)
    model = DDP(target)
    model.register_comm_hook(st, sparsify_hook)
    try:
        model(torch.randn(4, target[0].in_features)).sum().backward()
    except ValueError as exc:
        return str(exc)
    return None


FOREIGN = {
    "rank": r"rank \d loaded the hook state saved by rank \d: each rank must load its own file",
    "fewer_params": r"holds residuals for parameters \[1\] that this model does not have",
    "more_params": r"this model has parameters \[1\] for which the loaded hook state holds no residual",
    "other_shape": r"the error-feedback residual of parameter #0 has 16 elements but the parameter has 20",
}


def _foreign_states(rank, world):
    return {kind: _foreign_state(rank, world, kind) for kind in FOREIGN}


def test_state_of_another_rank_or_model_is_refused():
    import re

    for errors in run_distributed(_foreign_states, 2, timeout=120):
        for kind, message in FOREIGN.items():
            assert errors[kind] is not None and re.search(message, errors[kind]), (kind, errors[kind])


def _replicas_stay_equal(rank, world):
    for method, scope, aggregation in COMBOS:
        model = DDP(small_mlp(), bucket_cap_mb=0.002)
        model.register_comm_hook(SparsifyState(method=method, scope=scope, aggregation=aggregation, density=0.05, density_warmup_steps=0),
                                 sparsify_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        for step in range(4):
            opt.zero_grad()
            model(batch(rank, step)).pow(2).mean().backward()
            opt.step()
        assert_replicas_equal(model)
    return True


def test_replicas_stay_bitwise_equal():
    assert run_distributed(_replicas_stay_equal, 3, timeout=300) == [True] * 3


def _half_gradients(rank, world):
    out = {}
    for dtype in (torch.float16, torch.bfloat16):
        for method, aggregation in (("random_block", "allreduce"), ("topk", "allgather"), ("randomk", "allgather")):
            torch.manual_seed(0)
            module = torch.nn.Linear(50, 20).to(dtype)
            model = DDP(module)
            state = SparsifyState(method=method, aggregation=aggregation, density=0.1, density_warmup_steps=0)
            model.register_comm_hook(state, sparsify_hook)
            for step in range(3):
                model.zero_grad()
                model(batch(rank, step).repeat(1, 3)[:, :50].to(dtype)).float().pow(2).sum().backward()
            assert module.weight.grad.dtype == dtype
            assert all(t.dtype == torch.float32 for t in state.residuals.state().values())
            assert torch.isfinite(module.weight.grad.float()).all()
            out[(str(dtype), method)] = int((module.weight.grad != 0).sum())
            assert_replicas_equal(model)
    return out


def test_fp16_and_bf16_gradients_keep_float32_residuals():
    counts = run_distributed(_half_gradients, 2, timeout=120)[0]
    for (dtype, method), nnz in counts.items():
        if method == "randomk":  # two ranks' own positions: the union, k <= nnz <= 2k
            assert 100 <= nnz <= 200, (dtype, nnz)
        else:  # shared block, or top-k of similar gradients: at least k
            assert nnz >= 100, (dtype, method, nnz)

"""Sparse, error-fed synchronisation of Local AdaAlter and local SGD; any torch.optim optimizer as the outer one."""

import os

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_hooks.adaalter import (AdaAlterAverager, LocalAdaAlter, LocalSGDState, OuterOptimizer, OuterSGD,
                                SparseAverage, local_sgd_hook)
from ddp_hooks.testing import assert_replicas_equal, run_distributed

LR, EPS = 0.3, 0.8


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _step(ddp, opt, rank, it):
    g = torch.Generator().manual_seed(1000 * it + rank)
    x, y = torch.randn(8, 5, generator=g), torch.randn(8, 1, generator=g)
    torch.nn.functional.mse_loss(ddp(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _build(period=3, warmup=2, seed=0, sparse=None, **options):
    ddp = DDP(_model(seed))
    hook_state = LocalSGDState(warmup_steps=warmup)
    ddp.register_comm_hook(hook_state, local_sgd_hook)
    opt = LocalAdaAlter(ddp.parameters(), lr=LR, eps=EPS, period=period, warmup_steps=warmup,
                        sparse=None if sparse is None else SparseAverage(**sparse), **options)
    return ddp, hook_state, opt


def _gathered_sum(tensor):
    out = tensor.clone()
    torch.distributed.all_reduce(out)
    return out


def _conservation(rank, world_size, method, aggregation):
    """One exchange of known pseudo-gradients: x = x_a - mean_j c_j, bitwise the same on every rank, and
    nothing lost: W (x_a - x) + sum_j e_j = sum_j (x_a - x_j)."""
    torch.manual_seed(0)
    anchors = [torch.randn(40), torch.randn(3, 7)]
    sparse = SparseAverage(method=method, density=0.1, aggregation=aggregation)
    sparse.set_anchor(anchors)
    g = torch.Generator().manual_seed(rank)
    params = [a + torch.randn(a.shape, generator=g) for a in anchors]
    sent = sum((a - p).sum() for a, p in zip(anchors, params))
    sparse.average_(params, sparse.anchors, group=None)
    moved = sum((a - p).sum() for a, p in zip(anchors, params))
    total_sent = _gathered_sum(torch.tensor(float(sent)))
    total_kept = _gathered_sum(torch.tensor(sparse.residual_total()))
    counters = sparse.counters["parameters"]
    changed = sum(int((a != p).sum()) for a, p in zip(anchors, params))
    return [p.clone() for p in params], float(moved) * world_size + float(total_kept), float(total_sent), \
        counters.elements_sent, changed


@pytest.mark.parametrize("method, aggregation", [("random_block", None), ("shared_topk", None), ("topk", None),
                                                 ("randomk", "allgather")])
def test_sparse_average_is_the_same_on_every_rank_and_loses_nothing(method, aggregation):
    results = run_distributed(_conservation, 2, method, aggregation, timeout=60)
    (params0, conserved, total, elements, changed), (params1, *_) = results
    assert all(torch.equal(a, b) for a, b in zip(params0, params1))
    assert conserved == pytest.approx(total, rel=1e-5, abs=1e-4)
    assert elements == 4 + 3  # ceil(0.1 * 40) + ceil(0.1 * 21), one unit per parameter
    # the model moved where something was sent: at the shared positions, or at each rank's own
    if method in ("random_block", "shared_topk"):
        assert changed == elements
    else:
        assert elements < changed <= 2 * elements


def _train_sparse(rank, world_size, configs):
    out = []
    for sparse, options in configs:
        ddp, _, opt = _build(sparse=sparse, **options)
        for it in range(11):  # rounds of 3 after a warm-up of 2 (or 5): ends right after a synchronisation
            _step(ddp, opt, rank, it)
            if it == 7:  # after step 8, a synchronisation (of the parameters only, with H_acc = 6 from step 5)
                local_sq = sum(float(opt.state[p]["local_sq"].abs().sum()) for p in ddp.parameters())
        assert_replicas_equal(ddp.module)  # every rank the same weights, bitwise
        out.append(([p.detach().clone() for p in ddp.parameters()], local_sq,
                    None if opt.averager.sparse is None else opt.averager.sparse.residual_total(),
                    opt.averager.averagings))
    return out


TRAIN = [
    (None, {}),
    (dict(method="random_block", density=1.0), {}),
    (dict(method="shared_topk", density=0.2), dict(outer_lr=0.7, outer_momentum=0.9)),
    (dict(method="random_block", density=0.2), dict(compress_accumulators=True)),
    (dict(method="topk", density=0.2), dict(period=3, accumulator_period=6, warmup=5)),
]


def test_local_adaalter_with_sparse_synchronisation_trains_alike_on_every_rank():
    results = run_distributed(_train_sparse, 2, TRAIN, timeout=120)
    dense, full, outer, compressed, acc6 = results[0]
    # density 1 sends everything: x_a - mean_j (x_a - x_j) is the dense average up to rounding
    for a, b in zip(dense[0], full[0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert full[2] == 0.0
    for sparse_run in (outer, compressed, acc6):
        assert sparse_run[2] != 0.0  # something was kept back for later
        assert all(torch.isfinite(p).all() for p in sparse_run[0])
    # after step 8: H = 3 from step 2 has just averaged the accumulators; H_acc = 6 from step 5 has not
    assert dense[1] == 0.0 and acc6[1] > 0.0


def _accumulator_period(rank, world_size):
    ddp, _, opt = _build(period=2, warmup=0, accumulator_period=4)
    params = list(ddp.parameters())
    states = []
    for it in range(4):
        _step(ddp, opt, rank, it)
        states.append((sum(float(opt.state[p]["local_sq"].abs().sum()) for p in params),
                       [opt.state[p]["sum_sq"].clone() for p in params]))
    return states


def test_accumulators_on_their_own_period():
    (r0, r1) = run_distributed(_accumulator_period, 2, timeout=60)
    # step 2 averages the parameters only: each rank keeps its own accumulators, B2 unchanged (0)
    assert r0[1][0] > 0.0 and r0[1][0] != r1[1][0]
    assert all(float(s.abs().sum()) == 0.0 for s in r0[1][1])
    # step 4 averages them too: local ones zeroed, B2 the same on both ranks
    assert r0[3][0] == 0.0 and r1[3][0] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(r0[3][1], r1[3][1]))
    assert any(float(s.abs().sum()) > 0.0 for s in r0[3][1])


def test_bad_options_are_refused_with_the_reason():
    w = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=r"`accumulator_period` must be a multiple of `period`=4, got 6"):
        LocalAdaAlter([w], period=4, accumulator_period=6)
    with pytest.raises(ValueError, match="`compress_accumulators`=True needs `sparse`"):
        LocalAdaAlter([w], compress_accumulators=True)
    with pytest.raises(TypeError, match="`sparse` must be None or a SparseAverage, got dict"):
        LocalAdaAlter([w], sparse={"density": 0.1})
    with pytest.raises(ValueError, match="`outer_optimizer` was given with outer_lr=0.7"):
        LocalAdaAlter([w], outer_lr=0.7, outer_optimizer=torch.optim.SGD([w], lr=0.7))
    with pytest.raises(ValueError, match="the outer optimizer holds 1 parameters but 2 are averaged"):
        LocalAdaAlter([w, torch.nn.Parameter(torch.zeros(2))], outer_optimizer=torch.optim.SGD([w], lr=0.7))
    with pytest.raises(TypeError, match="`outer_optimizer` must be a torch.optim.Optimizer"):
        OuterOptimizer([w])
    with pytest.raises(ValueError, match=r"`density` must be a float in \(0, 1\], got 0.0"):
        SparseAverage(density=0.0)
    opt = LocalAdaAlter([w], sparse=SparseAverage())
    with pytest.raises(ValueError, match="cannot take a parameter group after construction"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})


def test_torch_sgd_as_the_outer_optimizer_computes_what_outer_sgd_computes():
    torch.manual_seed(0)
    start = [torch.randn(4, 3), torch.randn(5)]
    mine = [torch.nn.Parameter(t.clone()) for t in start]
    theirs = [torch.nn.Parameter(t.clone()) for t in start]
    outer_sgd = OuterSGD(lr=0.7, momentum=0.9, nesterov=True)
    torch_sgd = OuterOptimizer(torch.optim.SGD(theirs, lr=0.7, momentum=0.9, nesterov=True))
    outer_sgd.set_anchor(mine)
    torch_sgd.set_anchor(theirs)
    for round_ in range(5):
        step = [torch.randn(t.shape, generator=torch.Generator().manual_seed(10 * round_ + i))
                for i, t in enumerate(start)]
        with torch.no_grad():
            for a, b, s in zip(mine, theirs, step):
                a.sub_(s)
                b.sub_(s)
        inner = [torch.ones_like(p) for p in theirs]
        for p, g in zip(theirs, inner):
            p.grad = g
        outer_sgd.step_(mine)
        torch_sgd.step_(theirs)
        for a, b in zip(mine, theirs):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        assert all(p.grad is g for p, g in zip(theirs, inner))  # the inner gradients are put back


def _local_sgd_sparse(rank, world_size, folder, phase):
    """DiLoCo with SGD inside: post-local SGD's hook, momentum SGD, the averager with a sparse exchange and a
    torch.optim outer optimizer; a resume mid-round is bitwise."""
    from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as plsgd

    def build():
        ddp = DDP(_model(0))
        state = plsgd.PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=2,
                                        post_local_gradient_allreduce=False)
        ddp.register_comm_hook(state, plsgd.post_localSGD_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        outer = torch.optim.SGD(ddp.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        averager = AdaAlterAverager(period=3, warmup_steps=2, outer=outer,
                                    sparse=SparseAverage(method="shared_topk", density=0.25))
        return ddp, opt, averager, state

    def steps(ddp, opt, averager, its):
        synced = []
        for it in its:
            g = torch.Generator().manual_seed(1000 * it + rank)
            x, y = torch.randn(8, 5, generator=g), torch.randn(8, 1, generator=g)
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if averager.average_parameters(ddp.parameters()):
                assert_replicas_equal(ddp.module)
                synced.append(it)
        return synced

    path = os.path.join(folder, f"rank{rank}.pt")
    ddp, opt, averager, hook_state = build()
    if phase == "full":
        synced = steps(ddp, opt, averager, range(12))
        return [p.detach().clone() for p in ddp.parameters()], synced
    if phase == "save":
        steps(ddp, opt, averager, range(7))  # step 7 is mid-round (synchronisations after steps 5, 8, 11)
        torch.save({"model": ddp.module.state_dict(), "opt": opt.state_dict(),
                    "averager": averager.state_dict()}, path)
        return None
    ckpt = torch.load(path, weights_only=True)
    ddp.module.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    averager.load_state_dict(ckpt["averager"], ddp.parameters())
    hook_state.iter = 7  # PyTorch's hook counts its own steps (its state has no state_dict)
    steps(ddp, opt, averager, range(7, 12))
    return [p.detach().clone() for p in ddp.parameters()]


def test_local_sgd_with_sparse_exchange_and_torch_outer_resumes_bitwise(tmp_path):
    full = run_distributed(_local_sgd_sparse, 2, str(tmp_path), "full", timeout=60)
    assert full[0][1] == [4, 7, 10]
    run_distributed(_local_sgd_sparse, 2, str(tmp_path), "save", timeout=60)
    resumed = run_distributed(_local_sgd_sparse, 2, str(tmp_path), "resume", timeout=60)
    for rank in range(2):
        assert all(torch.equal(a, b) for a, b in zip(full[rank][0], resumed[rank]))


RESUME = [  # (sparse, options, steps before the save, steps after)
    (dict(method="random_block", density=0.2), dict(compress_accumulators=True), 6, 6),   # mid-round
    (dict(method="shared_topk", density=0.2), dict(outer_lr=0.7, outer_momentum=0.9), 8, 4),  # at a sync
    (dict(method="topk", density=0.2), dict(accumulator_period=6), 5, 10),  # a sync without the accumulators
]


def _resume(rank, world_size, folder, phase):
    out = []
    for c, (sparse, options, n1, n2) in enumerate(RESUME):
        path = os.path.join(folder, f"c{c}_rank{rank}.pt")
        if phase == "full":
            ddp, _, opt = _build(sparse=sparse, **options)
            for it in range(n1 + n2):
                _step(ddp, opt, rank, it)
            out.append([p.detach().clone() for p in ddp.parameters()])
        elif phase == "save":
            ddp, hook_state, opt = _build(sparse=sparse, **options)
            for it in range(n1):
                _step(ddp, opt, rank, it)
            torch.save({"model": ddp.module.state_dict(), "opt": opt.state_dict(), "hook": hook_state.state_dict()},
                       path)
        else:
            ckpt = torch.load(path, weights_only=True)
            ddp, hook_state, opt = _build(seed=123, sparse=sparse, **options)
            ddp.module.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["opt"])
            hook_state.load_state_dict(ckpt["hook"])
            for it in range(n1, n1 + n2):
                _step(ddp, opt, rank, it)
            out.append([p.detach().clone() for p in ddp.parameters()])
            if c == 0:  # the other rank's file: its residuals are not this rank's
                other = torch.load(os.path.join(folder, f"c{c}_rank{1 - rank}.pt"), weights_only=True)
                with pytest.raises(ValueError, match=f"saved by rank {1 - rank} of 2 .* residuals belong"):
                    opt.load_state_dict(other["opt"])
                _, _, dense = _build()
                with pytest.raises(ValueError, match="saved with a sparse synchronisation and this optimizer "
                                                     "has none"):
                    dense.load_state_dict(ckpt["opt"])
    return out


def test_sparse_synchronisation_resumes_bitwise_and_refuses_another_ranks_state(tmp_path):
    full = run_distributed(_resume, 2, str(tmp_path), "full", timeout=90)
    run_distributed(_resume, 2, str(tmp_path), "save", timeout=90)
    resumed = run_distributed(_resume, 2, str(tmp_path), "resume", timeout=90)
    for rank in range(2):
        for c in range(len(RESUME)):
            assert all(torch.equal(a, b) for a, b in zip(full[rank][c], resumed[rank][c])), (rank, RESUME[c])


def _low_precision(rank, world_size):
    """bfloat16 parameters cannot take every sent update: what their rounding leaves out stays in the residual,
    so W (x_a - x) + sum_j e_j is still sum_j (x_a - x_j)."""
    torch.manual_seed(0)
    anchors = [torch.randn(64).bfloat16()]
    sparse = SparseAverage(method="shared_topk", density=0.25)
    sparse.set_anchor(anchors)
    g = torch.Generator().manual_seed(rank)
    params = [(anchors[0].float() + 1e-3 * torch.randn(64, generator=g)).bfloat16()]
    sent = float((anchors[0].float() - params[0].float()).sum())
    sparse.average_(params, sparse.anchors, group=None)
    moved = float((anchors[0].float() - params[0].float()).sum())
    return moved * world_size + float(_gathered_sum(torch.tensor(sparse.residual_total()))), \
        float(_gathered_sum(torch.tensor(sent)))


def test_low_precision_parameters_keep_what_their_rounding_leaves_out():
    for kept, total in run_distributed(_low_precision, 2, timeout=60):
        assert kept == pytest.approx(total, rel=1e-4, abs=1e-5)


def test_sparse_average_needs_a_process_group():
    w = torch.nn.Parameter(torch.zeros(4))
    opt = LocalAdaAlter([w], period=1, sparse=SparseAverage(density=0.5))
    w.grad = torch.ones(4)
    with pytest.raises(RuntimeError, match="no process group is initialised: call torch.distributed"):
        opt.step()


def _mismatched(rank, world_size):
    density = 0.1 if rank == 0 else 0.2
    ddp, _, opt = _build(sparse=dict(density=density))
    with pytest.raises(ValueError, match="ranks were built with different .* sparse_average="):
        _step(ddp, opt, rank, 0)
    ddp, _, opt = _build(accumulator_period=3 if rank == 0 else 6)
    with pytest.raises(ValueError, match="rank 0 has accumulators_every=1 but rank 1 has accumulators_every=2"):
        _step(ddp, opt, rank, 0)
    return True


def test_ranks_with_different_sparse_or_accumulator_options_are_refused_alike():
    assert run_distributed(_mismatched, 2, timeout=60) == [True, True]


def test_outer_optimizer_states_load_only_into_their_own_kind_and_settings():
    w = torch.nn.Parameter(torch.zeros(3))
    saved = OuterOptimizer(torch.optim.SGD([w], lr=0.7, momentum=0.9, nesterov=True))
    saved.set_anchor([w])
    state = saved.state_dict()
    other = OuterOptimizer(torch.optim.SGD([w], lr=0.5, momentum=0.9, nesterov=True))
    with pytest.raises(ValueError, match="the checkpoint's outer optimizer is SGD with .*'outer_lr': 0.7"):
        other.load_state_dict(state, [w])
    assert other.anchors is None and other.optimizer.param_groups[0]["lr"] == 0.5  # refused before any change
    with pytest.raises(ValueError, match="is the built-in OuterSGD"):
        other.load_state_dict(OuterSGD().state_dict(), [w])
    with pytest.raises(ValueError, match="is a torch.optim optimizer and this one the built-in OuterSGD"):
        OuterSGD().check_loadable(state, [w])
    with pytest.raises(ValueError, match="anchors do not match the parameters' shapes"):
        OuterOptimizer(torch.optim.SGD([w], lr=0.7, momentum=0.9, nesterov=True)).load_state_dict(
            state, [torch.zeros(4)])

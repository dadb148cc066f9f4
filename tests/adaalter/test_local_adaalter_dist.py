"""Multi-process checks of Local AdaAlter on gloo against single-process simulations."""

import os

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_hooks.adaalter import LocalAdaAlter, LocalSGDState, build_local_adaalter, local_sgd_hook
from ddp_hooks.testing import assert_replicas_equal, run_distributed

LR, EPS = 0.3, 0.8


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))


def _batch(rank, it):
    g = torch.Generator().manual_seed(1000 * it + rank)
    return torch.randn(8, 5, generator=g), torch.randn(8, 1, generator=g)


def _grads(model, rank, it):
    model.zero_grad(set_to_none=True)
    x, y = _batch(rank, it)
    torch.nn.functional.mse_loss(model(x), y).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def _train(ddp, opt, rank, iters, scaler=None, inf_at=(), skip=()):
    for it in iters:
        if it in skip:
            continue
        x, y = _batch(rank, it)
        if it in inf_at and rank == 1:
            x[0, 0] = float("inf")
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        opt.zero_grad(set_to_none=True)


def _simulate(world, steps, period, warmup, lazy=True, outer=None):
    """Algorithm 2 of arXiv 1911.09030 for `world` workers in one process; returns each worker's params.

    ``lazy``: the correction rule (True/"paper", False/"constant", "rate"); ``outer``: ``(lr, momentum,
    nesterov)`` of an outer SGD applied to each average from the last synchronised parameters (at the first:
    those where the local steps began, the same for every worker).
    """
    rule = {True: "paper", False: "constant"}.get(lazy, lazy)
    models = [_model() for _ in range(world)]
    xs = [[p.detach().clone() for p in m.parameters()] for m in models]
    b2 = [torch.zeros_like(p) for p in xs[0]]
    rate = [torch.zeros_like(p) for p in xs[0]]  # the "rate" rule's r: B2's last growth per step
    acc = [[torch.zeros_like(p) for p in xs[0]] for _ in range(world)]
    anchor = None  # the outer optimizer's start: where the local steps begin
    velocity = [torch.zeros_like(p) for p in xs[0]]
    t0 = 0
    for t in range(1, steps + 1):
        gs = [_grads(models[i], i, t - 1) for i in range(world)]
        if t <= warmup:
            g = [sum(gi[k] for gi in gs) / world for k in range(len(b2))]
            for i in range(world):
                xs[i] = [x - LR * gk / torch.sqrt(b + EPS ** 2) for x, gk, b in zip(xs[i], g, b2)]
            b2 = [b + gk * gk for b, gk in zip(b2, g)]
            rate = [gk * gk for gk in g]
            t0 = t
        else:
            if outer is not None and anchor is None:
                anchor = [x.clone() for x in xs[0]]
            if rule == "rate":
                denom = [b + EPS ** 2 + (t - t0 - 1) * r for b, r in zip(b2, rate)]
            else:
                denom = [b + ((t - t0) if rule == "paper" else 1) * EPS ** 2 for b in b2]
            for i in range(world):
                xs[i] = [x - LR * gk / torch.sqrt(d) for x, gk, d in zip(xs[i], gs[i], denom)]
                acc[i] = [a + gk * gk for a, gk in zip(acc[i], gs[i])]
            if t - t0 == period:
                mean_x = [sum(x[k] for x in xs) / world for k in range(len(b2))]
                if outer is not None:
                    olr, om, nesterov = outer
                    deltas = [a - m for a, m in zip(anchor, mean_x)]
                    velocity = [om * v + d for v, d in zip(velocity, deltas)]
                    steps_ = [d + om * v for d, v in zip(deltas, velocity)] if nesterov else velocity
                    mean_x = [a - olr * u for a, u in zip(anchor, steps_)]
                    anchor = [m.clone() for m in mean_x]
                mean_acc = [sum(a[k] for a in acc) / world for k in range(len(b2))]
                rate = [m / period for m in mean_acc]
                b2 = [b + m for b, m in zip(b2, mean_acc)]
                xs = [[m.clone() for m in mean_x] for _ in range(world)]
                acc = [[torch.zeros_like(p) for p in b2] for _ in range(world)]
                t0 = t
        for m, x in zip(models, xs):
            with torch.no_grad():
                for p, v in zip(m.parameters(), x):
                    p.copy_(v)
    return xs


def _sync_adaalter_period_1(world, steps):
    """Synchronous AdaAlter's update on the averaged gradient, with B2 += mean_j g_j^2 (and (mean g)^2 beside)."""
    model = _model()
    x = [p.detach().clone() for p in model.parameters()]
    b2_mean_sq = [torch.zeros_like(p) for p in x]
    b2_sq_mean = [torch.zeros_like(p) for p in x]
    for t in range(steps):
        gs = [_grads(model, i, t) for i in range(world)]
        g = [sum(gi[k] for gi in gs) / world for k in range(len(x))]
        x = [xk - LR * gk / torch.sqrt(b + EPS ** 2) for xk, gk, b in zip(x, g, b2_mean_sq)]
        b2_mean_sq = [b + sum(gi[k] * gi[k] for gi in gs) / world for k, b in enumerate(b2_mean_sq)]
        b2_sq_mean = [b + gk * gk for b, gk in zip(b2_sq_mean, g)]
        with torch.no_grad():
            for p, v in zip(model.parameters(), x):
                p.copy_(v)
    return x, b2_mean_sq, b2_sq_mean


# (period, warmup, steps, lazy correction, built separately?, outer (lr, momentum, nesterov) or None)
CONFIGS = [(1, 0, 6, True, False, None), (3, 2, 8, True, True, None), (2, 1, 6, False, False, None),
           (3, 1, 10, "rate", False, None), (2, 2, 9, "rate", True, (0.7, 0.9, True)),
           (3, 0, 9, "paper", False, (0.5, 0.5, False))]


def _outer_kwargs(outer):
    return {} if outer is None else dict(outer_lr=outer[0], outer_momentum=outer[1], outer_nesterov=outer[2])


def _train_configs(rank, world_size, configs):
    out = []
    for period, warmup, steps, lazy, separate, outer in configs:
        ddp = DDP(_model())
        if separate:  # the API other code uses: built apart, linked through the parameters
            hook_state = LocalSGDState(process_group=None, warmup_steps=warmup)
            ddp.register_comm_hook(hook_state, local_sgd_hook)
            opt = LocalAdaAlter(ddp.parameters(), lr=LR, eps=EPS, period=period, warmup_steps=warmup,
                                lazy_correction=lazy, **_outer_kwargs(outer))
        else:
            hook_state, opt = build_local_adaalter(ddp, lr=LR, eps=EPS, period=period, warmup_steps=warmup,
                                                   lazy_correction=lazy, **_outer_kwargs(outer))
        _train(ddp, opt, rank, range(steps))
        if opt.schedule.last_sync == steps:
            assert_replicas_equal(ddp)
        out.append({"params": [p.detach().clone() for p in ddp.parameters()],
                    "sum_sq": [opt.state[p]["sum_sq"].clone() for p in ddp.parameters()],
                    "linked": hook_state.schedule is opt.schedule,
                    "allreduce_calls": hook_state.allreduce_calls})
    return out


def _check_against_simulation(results, world, configs):
    for c, (period, warmup, steps, lazy, _, outer) in enumerate(configs):
        sim = _simulate(world, steps, period, warmup, lazy, outer)
        for rank in range(world):
            got = results[rank][c]
            assert got["linked"] and got["allreduce_calls"] == warmup  # one bucket per warm-up step, none after
            for a, b in zip(got["params"], sim[rank]):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    return sim


def _world1_body(rank, world_size):
    out = _train_configs(rank, world_size, CONFIGS[:1])
    ddp = DDP(_model())
    ddp.register_comm_hook(LocalSGDState(warmup_steps=2), local_sgd_hook)
    LocalAdaAlter(ddp.parameters(), lr=LR, eps=EPS, period=2, warmup_steps=3)
    x, y = _batch(rank, 0)
    try:
        torch.nn.functional.mse_loss(ddp(x), y).backward()
    except Exception as exc:  # raised from inside the hook, through the reducer
        return out, str(exc)
    return out, None


def test_single_rank_ddp_period_1_is_adaalter_and_warmup_mismatch_raises():
    (out, err), = run_distributed(_world1_body, 1, timeout=60)
    _check_against_simulation([out], 1, CONFIGS[:1])
    ref, _, _ = _sync_adaalter_period_1(1, 6)  # written independently of the simulation
    for a, b in zip(out[0]["params"], ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert err is not None and "`warmup_steps`=2 but the LocalAdaAlter schedule it is used with has " \
                              "`warmup_steps`=3" in err


def test_four_ranks_match_single_process_simulation():
    results = run_distributed(_train_configs, 4, CONFIGS[1:], timeout=90)
    _check_against_simulation(results, 4, CONFIGS[1:])


def _two_rank_body(rank, world_size):
    return _train_configs(rank, world_size, CONFIGS), _amp_and_unused(rank)


def _amp_and_unused(rank):
    # 1. GradScaler: inf on rank 1 in warm-up (iteration 2) and in a local step (6) vs a run skipping both.
    ddp = DDP(_model())
    hook_state, opt = build_local_adaalter(ddp, lr=LR, eps=EPS, period=2, warmup_steps=3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    _train(ddp, opt, rank, range(9), scaler=scaler, inf_at=(2, 6))
    ref = DDP(_model())
    _, ref_opt = build_local_adaalter(ref, lr=LR, eps=EPS, period=2, warmup_steps=3)
    _train(ref, ref_opt, rank, range(9), skip=(2, 6))
    assert_replicas_equal(ddp)
    amp = {"params": [p.detach().clone() for p in ddp.parameters()],
           "ref": [p.detach().clone() for p in ref.parameters()],
           "schedule": opt.schedule.state_dict(), "allreduce_calls": hook_state.allreduce_calls,
           "amp_agreements": opt.amp_agreements}
    # 2. A parameter that only rank 0 ever gives a gradient, without DDP: averaged all the same.
    used, extra = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.full((3,), 7.0))
    opt2 = LocalAdaAlter([used, extra], lr=0.5, eps=1.0, period=2, lazy_correction="paper")  # (see the check)
    for _ in range(2):
        used.grad = torch.full((2,), float(rank + 1))
        extra.grad = torch.ones(3) if rank == 0 else None
        opt2.step()
    unused = {"extra": extra.detach().clone(), "sum_sq": opt2.state[extra]["sum_sq"].clone()}
    # 3. DDP with a branch only rank 0 uses: no deadlock, replicas equal after each averaging.
    torch.manual_seed(0)
    branch = torch.nn.ModuleDict({"a": torch.nn.Linear(5, 1), "b": torch.nn.Linear(5, 1)})

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = branch

        def forward(self, x):
            return self.m["a"](x) + (self.m["b"](x) if rank == 0 else 0)

    net = DDP(Net(), find_unused_parameters=True)
    _, opt3 = build_local_adaalter(net, lr=LR, eps=EPS, period=2, warmup_steps=1)
    _train(net, opt3, rank, range(5))
    assert opt3.schedule.last_sync == 5
    assert_replicas_equal(net)
    return amp, unused


def test_two_ranks_simulation_period_1_grad_scaler_skips_and_unused_params():
    results = run_distributed(_two_rank_body, 2, timeout=90)  # one spawn, several checks
    _check_against_simulation([r[0] for r in results], 2, CONFIGS)
    # period 1: synchronous AdaAlter's update, but the accumulator grows by the mean of squares
    ref_x, mean_sq, sq_mean = _sync_adaalter_period_1(2, 6)
    for rank in range(2):
        for a, b in zip(results[rank][0][0]["params"], ref_x):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        for a, b, c in zip(results[rank][0][0]["sum_sq"], mean_sq, sq_mean):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            assert not torch.allclose(a, c, rtol=1e-3, atol=0)
    for rank, (_, (amp, unused)) in enumerate(results):
        # 9 iterations, 2 skipped: 7 steps; warm-up took steps 1-3 (4 iterations), syncs at 5 and 7
        assert amp["schedule"] == {"warmup_steps": 3, "period": 2, "step": 7, "last_sync": 7}
        assert amp["allreduce_calls"] == 4  # the skipped warm-up iteration is repeated, not counted
        assert amp["amp_agreements"] == 5  # iterations 4-8 are local: one agreement each
        for a, b in zip(amp["params"], amp["ref"]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        x0 = 7.0 - 0.5 / 1.0 - 0.5 / 2.0 ** 0.5  # rank 0's two local steps, denominators sqrt(0 + k)
        torch.testing.assert_close(unused["extra"], torch.full((3,), (x0 + 7.0) / 2))
        torch.testing.assert_close(unused["sum_sq"], torch.full((3,), 1.0))  # mean of A = (2 + 0) / 2


# Resume: (period, warmup, steps before the checkpoint, steps after, options); checkpoints mid-round
RESUME = [(4, 3, 5, 5, {}), (2, 4, 2, 6, {}),
          (3, 1, 6, 7, dict(lazy_correction="rate", outer_lr=0.7, outer_momentum=0.9))]


def _build(period, warmup, seed=0, **options):
    ddp = DDP(_model(seed))
    hook_state = LocalSGDState(warmup_steps=warmup)
    ddp.register_comm_hook(hook_state, local_sgd_hook)
    opt = LocalAdaAlter(ddp.parameters(), lr=LR, eps=EPS, period=period, warmup_steps=warmup, **options)
    return ddp, hook_state, opt


def _resume_first(rank, world_size, folder):
    full = []
    for c, (period, warmup, n1, n2, options) in enumerate(RESUME):
        ddp, _, opt = _build(period, warmup, **options)
        _train(ddp, opt, rank, range(n1 + n2))
        full.append([p.detach().clone() for p in ddp.parameters()])
        ddp, hook_state, opt = _build(period, warmup, **options)
        _train(ddp, opt, rank, range(n1))
        torch.save({"model": ddp.module.state_dict(), "opt": opt.state_dict(), "hook": hook_state.state_dict()},
                   os.path.join(folder, f"c{c}_rank{rank}.pt"))
    return full


def _resume_second(rank, world_size, folder):
    out = []
    for c, (period, warmup, n1, n2, options) in enumerate(RESUME):
        ckpt = torch.load(os.path.join(folder, f"c{c}_rank{rank}.pt"), weights_only=True)
        ddp, hook_state, opt = _build(period, warmup, seed=123, **options)  # other init: the checkpoint must matter
        ddp.module.load_state_dict(ckpt["model"])  # after DDP's broadcast: ranks differ between averagings
        opt.load_state_dict(ckpt["opt"])
        hook_state.load_state_dict(ckpt["hook"])
        _train(ddp, opt, rank, range(n1, n1 + n2))
        out.append([p.detach().clone() for p in ddp.parameters()])
    return out


def test_checkpoint_resume_is_bitwise_exact(tmp_path):
    full = run_distributed(_resume_first, 2, str(tmp_path), timeout=90)
    resumed = run_distributed(_resume_second, 2, str(tmp_path), timeout=90)
    for rank in range(2):
        for c in range(len(RESUME)):
            for a, b in zip(full[rank][c], resumed[rank][c]):
                assert torch.equal(a, b), (rank, RESUME[c])

"""Momentum and weight decay in the sparsifying hook: convergence, parity, mass, pairing checks."""

import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_hooks import SparsifyState, build_sparsify_sgd, check_optimizer, sparsify_hook
from ddp_hooks._internal.codec import float_to_bits
from ddp_hooks.testing import run_distributed
from small_mlp import batch, flat, small_mlp

COMBOS = [("topk", s, "allgather") for s in ("layer", "bucket", "global")] + [
    (m, s, a) for m in ("randomk", "random_block") for s in ("layer", "bucket", "global") for a in ("allreduce", "allgather")
]
M, WD = 0.9, 5e-4

_model, _batch, _flat = small_mlp, batch, flat


# ----- options, state dicts, pairing (one process) -----

@pytest.mark.parametrize("kwargs,exc,pattern", [
    ({"momentum": 1.0}, ValueError, r"`momentum` must be a float in \[0, 1\), got 1.0; it is the factor"),
    ({"momentum": -0.1}, ValueError, r"`momentum` must be a float in \[0, 1\), got -0.1"),
    ({"momentum": "0.9"}, TypeError, r"`momentum` must be a float, got '0.9'"),
    ({"weight_decay": -1e-4}, ValueError, r"`weight_decay` must be a float in \[0, inf\), got -0.0001"),
    ({"weight_decay": float("nan")}, ValueError, r"`weight_decay` must be a float in \[0, inf\), got nan"),
    ({"momentum": 0.9, "error_feedback": False}, ValueError, r"`momentum`=0.9 needs `error_feedback`=True"),
])
def test_bad_momentum_options_are_refused(kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        SparsifyState(**kwargs)


def test_momentum_options_travel_exactly_through_a_checkpoint(tmp_path):
    st = SparsifyState(method="randomk", density=0.2, momentum=0.9, weight_decay=5e-4)
    st.velocities.load({0: torch.full((3,), 2.0)})
    torch.save(st.state_dict(), tmp_path / "s.pt")
    sd = torch.load(tmp_path / "s.pt", weights_only=True)
    assert sd["config"]["momentum_bits"] == float_to_bits(0.9)
    other = SparsifyState(method="randomk", density=0.2, momentum=0.9, weight_decay=5e-4)
    other.load_state_dict(sd)
    assert torch.equal(other.state_dict()["velocities"][0], torch.full((3,), 2.0))
    with pytest.raises(ValueError, match="saved with .*momentum=0.9, weight_decay=0.0005, .* but .*momentum=0.8"):
        SparsifyState(method="randomk", density=0.2, momentum=0.8, weight_decay=5e-4).load_state_dict(sd)


def test_pickling_keeps_momentum_options_and_velocities():
    import pickle

    st = SparsifyState(method="randomk", momentum=0.9, weight_decay=WD)
    st.velocities.load({0: torch.ones(3)})
    back = pickle.loads(pickle.dumps(st))
    assert (back.momentum, back.weight_decay) == (0.9, WD)
    assert torch.equal(back.state_dict()["velocities"][0], torch.ones(3))


def test_a_state_saved_before_the_momentum_option_loads_as_momentum_zero():
    sd = SparsifyState(density=0.1).state_dict()
    del sd["config"]["momentum_bits"], sd["config"]["weight_decay_bits"], sd["velocities"]
    SparsifyState(density=0.1).load_state_dict(sd)
    with pytest.raises(ValueError, match="saved with .*momentum=0, weight_decay=0, .* but"):
        SparsifyState(density=0.1, momentum=0.5).load_state_dict(sd)


def _sgd(momentum, weight_decay=0.0):
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1, momentum=momentum, weight_decay=weight_decay)


def test_check_optimizer_refuses_momentum_or_decay_applied_twice():
    with pytest.raises(ValueError, match=r"momentum would be applied twice: SparsifyState\(momentum=0.9\)"):
        check_optimizer(SparsifyState(momentum=0.9), _sgd(0.9))
    with pytest.raises(ValueError, match="weight decay would be applied twice"):
        check_optimizer(SparsifyState(momentum=0.9, weight_decay=WD), _sgd(0.0, WD))


@pytest.mark.parametrize("method", ["randomk", "random_block"])
def test_check_optimizer_warns_about_the_combination_known_to_diverge(method):
    aggregation = "allgather"
    with pytest.warns(UserWarning, match=f"method='{method}' with error feedback under the optimizer's momentum"):
        check_optimizer(SparsifyState(method=method, aggregation=aggregation, optimizer_momentum="steps"), _sgd(0.9))


def test_check_optimizer_warns_when_weight_decay_skips_the_hooks_momentum():
    with pytest.warns(UserWarning, match="the decay skips the momentum, unlike torch.optim.SGD"):
        check_optimizer(SparsifyState(momentum=0.9), _sgd(0.0, WD))


def test_check_optimizer_accepts_the_safe_pairings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_optimizer(SparsifyState(momentum=0.9, weight_decay=WD), _sgd(0.0))
        check_optimizer(SparsifyState(method="topk", aggregation="allgather"), _sgd(0.9, WD))
        check_optimizer(SparsifyState(method="randomk", error_feedback=False), _sgd(0.9, WD))
        check_optimizer(SparsifyState(method="shared_topk"), torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))]))
        check_optimizer(SparsifyState(method="topk", aggregation="allgather"),
                        torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))]))
        check_optimizer(SparsifyState(method="randomk", error_feedback=False),
                        torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))]))


@pytest.mark.parametrize("method", ["random_block", "randomk"])
@pytest.mark.parametrize("optimizer", ["Adam", "AdamW", "RMSprop", "Adagrad", "Adafactor", "betas"])
def test_check_optimizer_warns_about_a_random_selector_under_an_adaptive_optimizer(method, optimizer):
    w = torch.nn.Parameter(torch.zeros(2))
    if not hasattr(torch.optim, optimizer) and optimizer != "betas":
        pytest.skip(f"torch {torch.__version__} has no torch.optim.{optimizer}")
    if optimizer == "betas":  # a third-party Adam-like optimizer (LAMB, Lion, ...): known by its betas
        opt = torch.optim.SGD([w], lr=0.1)
        opt.param_groups[0]["betas"] = (0.9, 0.99)
    else:
        opt = getattr(torch.optim, optimizer)([w])
    with pytest.warns(UserWarning, match=f"method='{method}' with error feedback under .*adaptive.*shared_topk"):
        check_optimizer(SparsifyState(method=method), opt)


# ----- convergence: the hazard of issue 8, in seconds -----

def _teacher_task(rank, steps, batch=32):
    teacher = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
    data = []
    for step in range(steps):
        x = torch.randn(batch, 16, generator=torch.Generator().manual_seed(1 + 2 * step + rank))
        data.append((x, (x @ teacher).argmax(1)))
    x = torch.randn(512, 16, generator=torch.Generator().manual_seed(10**6))
    return data, (x, (x @ teacher).argmax(1))


def _converge(rank, world, steps=200):
    data, (x_eval, y_eval) = _teacher_task(rank, steps)
    out = {}
    for kind in ("dense", "optimizer momentum as is", "unchanged code", "build_sparsify_sgd"):
        torch.manual_seed(0)
        ddp = DDP(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)))
        caught = []
        sparse = dict(method="random_block", density=0.05, density_warmup_steps=0)  # momentum in sends alone
        if kind == "build_sparsify_sgd":
            _, opt = build_sparsify_sgd(ddp, lr=0.1, momentum=M, weight_decay=WD, **sparse)
        else:
            if kind == "dense":
                ddp.register_comm_hook(None, allreduce_hook)
            elif kind == "unchanged code":  # SGD's momentum, counted in sends by the hook
                ddp.register_comm_hook(SparsifyState(**sparse), sparsify_hook)
            else:  # the pairing shipped before issue 8: error feedback on the gradient, momentum in SGD
                ddp.register_comm_hook(SparsifyState(optimizer_momentum="steps", **sparse), sparsify_hook)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=M, weight_decay=WD)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for x, y in data:
                opt.zero_grad()
                torch.nn.functional.cross_entropy(ddp(x), y).backward()
                opt.step()
        with torch.no_grad():
            logits = ddp.module(x_eval)
            loss = torch.nn.functional.cross_entropy(logits, y_eval).item()
            acc = (logits.argmax(1) == y_eval).float().mean().item()
        out[kind] = (loss, acc, [str(w.message) for w in caught])
    return out


def test_random_block_with_momentum_sgd_converges_where_optimizer_momentum_diverges():
    """2 ranks, MLP, teacher labels, lr 0.1, momentum 0.9, wd 5e-4, 200 steps, density 0.05."""
    res = run_distributed(_converge, 2, timeout=120)[0]
    dense_loss, dense_acc, _ = res["dense"]
    assert dense_loss < 0.2 and dense_acc > 0.93, res["dense"]
    for kind in ("build_sparsify_sgd", "unchanged code"):
        loss, acc, built_warnings = res[kind]
        assert loss < 0.5 and acc > 0.9, (kind, res[kind])
        assert not any("diverge" in w or "twice" in w for w in built_warnings), built_warnings
    # the optimizer's momentum as is: it multiplies each stale burst by 1/(1 - 0.9), and the loss explodes
    old_loss, _, old_warnings = res["optimizer momentum as is"]
    assert not old_loss < 5.0, res["optimizer momentum as is"]
    assert any("known to diverge" in w for w in old_warnings), old_warnings


# ----- density 1: the pair is momentum SGD with weight decay -----

def _train(model, opt, rank, steps=6):
    for step in range(steps):
        opt.zero_grad()
        model(_batch(rank, step)).pow(2).mean().backward()
        opt.step()
    return _flat(model.parameters())


def _parity(rank, world):
    dense = DDP(_model(), bucket_cap_mb=0.002)
    dense.register_comm_hook(None, allreduce_hook)
    ref = _train(dense, torch.optim.SGD(dense.parameters(), lr=0.05, momentum=M, weight_decay=WD), rank)
    diffs = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # density=1
        for method, scope, aggregation in COMBOS:
            model = DDP(_model(), bucket_cap_mb=0.002)
            state = SparsifyState(method=method, density=1.0, scope=scope, aggregation=aggregation, warmup_steps=2,
                                  momentum=M, weight_decay=WD)
            model.register_comm_hook(state, sparsify_hook)
            diffs[(method, scope, aggregation)] = (_train(model, torch.optim.SGD(model.parameters(), lr=0.05), rank)
                                                   - ref).abs().max().item()
        model = DDP(_model(), bucket_cap_mb=0.002)
        state, opt = build_sparsify_sgd(model, lr=0.05, momentum=M, weight_decay=WD, method="randomk", density=1.0)
        assert state.counts_momentum_in_sends and state.momentum == 0.0 and opt.defaults["momentum"] == M
        diffs["build_sparsify_sgd"] = (_train(model, opt, rank) - ref).abs().max().item()
    return diffs, ref.abs().max().item()


def test_density_one_with_hook_momentum_equals_momentum_sgd_with_weight_decay():
    diffs, scale = run_distributed(_parity, 2, timeout=300)[0]
    for combo, diff in diffs.items():
        assert diff < 1e-6 * scale, (combo, diff)  # float rounding: each rank's velocity is averaged


def test_build_sparsify_sgd_builds_the_users_own_sgd():
    assert SparsifyState(method="random_block").counts_momentum_in_sends
    assert SparsifyState(method="topk", aggregation="allgather").counts_momentum_in_sends
    assert not SparsifyState(method="randomk", error_feedback=False).counts_momentum_in_sends


# ----- mass: sum of what a rank sent + its residual == sum of its gradients + momentum's carry at sends -----

def _recording_hook(rec, bucket):
    for p, g in zip(bucket.parameters(), bucket.gradients()):
        rec["g"][id(p)] = g.detach().clone()
    return sparsify_hook(rec["state"], bucket)


def _by_param(state_of, params):
    return torch.cat([state_of(p).reshape(-1).double() for p in params])


def _mass(rank, world, steps=12, warmup=2):
    out = []
    for method, scope, aggregation in COMBOS:
        state = SparsifyState(method=method, density=0.05, scope=scope, aggregation=aggregation, momentum=M,
                              weight_decay=WD, warmup_steps=warmup, density_warmup_steps=0)
        model = DDP(_model(), bucket_cap_mb=0.002)  # several buckets, rebuilt after the first step
        rec = {"state": state, "g": {}}
        model.register_comm_hook(rec, _recording_hook)
        params = list(model.parameters())
        applied = torch.zeros(sum(p.numel() for p in params), dtype=torch.float64)
        inflow = torch.zeros_like(applied)  # gradients + weight decay + momentum's carry at the sent positions
        worst_velocity = 0.0
        for step in range(steps):
            x = _flat(params).double()
            w_old = _by_param(state.velocity_for, params)
            e_old = _by_param(state.residual_for, params)
            model.zero_grad()
            model(_batch(rank, step)).pow(2).sum().backward()
            g = torch.cat([rec["g"][id(p)].reshape(-1) for p in params]).double() + WD * x
            p_comp = e_old + g
            e_new = _by_param(state.residual_for, params)
            w_new = _by_param(state.velocity_for, params)
            sent = (e_new == 0) & (p_comp != 0)
            assert step >= warmup or bool(sent.all()), "warm-up sends every position"
            expected_w = torch.where(sent, M * w_old + p_comp, w_old)
            worst_velocity = max(worst_velocity, (w_new - expected_w).abs().max().item())
            inflow += g + torch.where(sent, M * w_old, torch.zeros_like(w_old))
            applied += _flat(p.grad for p in params).double()
            with torch.no_grad():  # move the model, so that weight decay sees changing parameters
                for p in params:
                    p.sub_(0.01 * p.grad)
        e = _by_param(state.residual_for, params)
        dist.all_reduce(e)
        dist.all_reduce(inflow)
        err = (applied + e / world - inflow / world).abs().max().item()
        out.append((method, scope, aggregation, err, inflow.abs().max().item(), worst_velocity, e.abs().sum().item()))
    return out


def test_mass_is_conserved_and_the_velocity_moves_only_where_sent():
    for method, scope, aggregation, err, scale, worst_velocity, residual in run_distributed(_mass, 2, timeout=300)[0]:
        assert residual > 0, "a residual must remain at density 0.05"
        assert err < 1e-5 * max(1.0, scale), (method, scope, aggregation, err, scale)
        assert worst_velocity < 1e-4 * max(1.0, scale), (method, scope, aggregation, worst_velocity)


# (exact resume with velocities: tests/sparsify/test_sparsify_dist.py, test_checkpoint_resume_is_exact)


def _mismatch(rank, world):
    model = DDP(_model())
    model.register_comm_hook(SparsifyState(density=0.1, momentum=0.9 if rank == 0 else 0.8), sparsify_hook)
    model(_batch(rank, 0)).sum().backward()


def test_ranks_with_different_momentum_all_raise():
    with pytest.raises(ValueError, match="rank 0 has .*momentum=0.9.* but rank 1 has .*momentum=0.8"):
        run_distributed(_mismatch, 2, timeout=60)


def _double_momentum(rank, world):
    model = DDP(_model())
    model.register_comm_hook(SparsifyState(density=0.1, momentum=0.9), sparsify_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(_batch(rank, 0)).sum().backward()
    opt.step()


def test_an_optimizer_adding_its_own_momentum_is_refused_at_its_first_step():
    with pytest.raises(ValueError, match="momentum would be applied twice"):
        run_distributed(_double_momentum, 2, timeout=60)

"""The optimizer's own momentum counted in sends (``optimizer_momentum="sends"``), in unchanged SGD code."""

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_hooks import SparsifyState, check_optimizer, sparsify_hook
from ddp_hooks.testing import run_distributed
from small_mlp import batch, flat, last_update_dense, small_mlp

M = 0.9
OPTIONS = dict(method="random_block", density=0.1, block_size=4, density_warmup_steps=0)

_model, _batch, _flat = small_mlp, batch, flat


def _buffer_holds_the_sent_velocity(rank, world, scope, aggregation, groups):
    model = DDP(_model())
    state = SparsifyState(scope=scope, aggregation=aggregation, **OPTIONS)
    model.register_comm_hook(state, sparsify_hook)
    params = list(model.parameters())
    if groups:  # several groups, each its own momentum
        opt = torch.optim.SGD([{"params": params[:2], "momentum": 0.9}, {"params": params[2:], "momentum": 0.5}],
                              lr=0.05)
    else:
        opt = torch.optim.SGD(params, lr=0.05, momentum=M)
    worst = 0.0
    for step in range(12):
        opt.zero_grad()
        model(_batch(rank, step)).pow(2).mean().backward()
        opt.step()
        buf = _flat(opt.state[p]["momentum_buffer"] for p in params)
        u = last_update_dense(state, model.module)
        worst = max(worst, float((buf - u).abs().max() / u.abs().max()))
        sparse = float((u != 0).float().mean())
    return worst, sparse


@pytest.mark.parametrize("scope,aggregation,groups", [("layer", "allreduce", False), ("global", "allgather", False),
                                                      ("layer", "allgather", True)])
def test_the_optimizers_buffer_holds_exactly_what_was_sent(scope, aggregation, groups):
    # The hook returns u_t - m u_{t-1}: SGD's m buf + grad is then u_t, a sparse vector, step after step.
    for worst, sparse in run_distributed(_buffer_holds_the_sent_velocity, 2, scope, aggregation, groups):
        assert worst < 1e-5
        assert sparse < 0.25  # at most two ranks' 10 % (AllGather), not the dense buffer of plain momentum


def _train(rank, world, mode, steps=15, clip=None, schedule=None):
    model = DDP(_model())
    if mode == "sends":
        model.register_comm_hook(SparsifyState(**OPTIONS), sparsify_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=M)
    else:  # the hook's own velocity, plain SGD: the same momentum in sends
        model.register_comm_hook(SparsifyState(momentum=M, **OPTIONS), sparsify_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        opt.zero_grad()
        model(_batch(rank, step)).pow(2).mean().backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if schedule is not None:
            for group in opt.param_groups:
                group["momentum"] = schedule(step)
        opt.step()
    return _flat(model.parameters())


def test_counting_the_optimizers_momentum_equals_the_hooks_own_momentum():
    sends = run_distributed(_train, 2, "sends")
    own = run_distributed(_train, 2, "own")
    torch.testing.assert_close(sends[0], own[0], rtol=1e-5, atol=1e-6)
    assert torch.equal(sends[0], sends[1])  # replicas stay bitwise equal


def _alternating_momentum(step):
    return 0.5 + 0.4 * (step % 2)


def test_gradient_clipping_and_a_momentum_schedule_in_user_code_keep_training_finite():
    for clip, schedule in ((0.05, None), (None, _alternating_momentum)):
        out = run_distributed(_train, 2, "sends", 20, clip, schedule)
        assert torch.isfinite(out[0]).all() and torch.equal(out[0], out[1])


def _resume(rank, world, tmp, split, total=8):
    def build():
        model = DDP(_model())
        state = SparsifyState(**OPTIONS)
        model.register_comm_hook(state, sparsify_hook)
        return model, state, torch.optim.SGD(model.parameters(), lr=0.05, momentum=M, weight_decay=5e-4)

    model, state, opt = build()
    for step in range(total if split is None else split):
        opt.zero_grad()
        model(_batch(rank, step)).pow(2).mean().backward()
        opt.step()
    if split is None:
        return _flat(model.parameters())
    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "hook": state.state_dict()},
               f"{tmp}/ck{rank}.pt")
    del model, state, opt
    model, state, opt = build()
    ck = torch.load(f"{tmp}/ck{rank}.pt", weights_only=True)
    model.module.load_state_dict(ck["model"])
    opt.load_state_dict(ck["opt"])
    state.load_state_dict(ck["hook"])
    for step in range(split, total):
        opt.zero_grad()
        model(_batch(rank, step)).pow(2).mean().backward()
        opt.step()
    return _flat(model.parameters())


def test_resume_with_the_optimizers_momentum_in_sends_is_bitwise(tmp_path):
    straight = run_distributed(_resume, 2, str(tmp_path), None)
    resumed = run_distributed(_resume, 2, str(tmp_path), 3)  # resumes on DDP's initial buckets
    assert torch.equal(straight[0], resumed[0]) and torch.equal(straight[1], resumed[1])


def _nonfinite_step(rank, world):
    model = DDP(_model())
    state = SparsifyState(**OPTIONS)
    model.register_comm_hook(state, sparsify_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=M)
    for step in range(6):
        opt.zero_grad()
        loss = model(_batch(rank, step)).pow(2).mean()
        if step == 3 and rank == 1:
            loss = loss * float("inf")
        loss.backward()
        grads_finite = all(torch.isfinite(p.grad).all() for p in model.parameters())
        if grads_finite:  # what GradScaler does: skip the step
            opt.step()
    buf = _flat(opt.state[p]["momentum_buffer"] for p in model.parameters())
    u = last_update_dense(state, model.module)
    return float((buf - u).abs().max() / u.abs().max()), state.stats()["nonfinite_steps"]


def test_a_skipped_step_leaves_the_remembered_update_as_the_optimizers_buffer():
    for gap, nonfinite in run_distributed(_nonfinite_step, 2):
        assert nonfinite == 1 and gap < 1e-5


def _no_sync(rank, world, static_graph):
    model = DDP(_model(), static_graph=static_graph)
    state = SparsifyState(**OPTIONS)
    model.register_comm_hook(state, sparsify_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=M)
    for step in range(6):
        opt.zero_grad()
        if step > 0:  # (DDP's static graph must see one synchronised backward first)
            with model.no_sync():
                model(_batch(rank, 100 + step)).pow(2).mean().backward()
        model(_batch(rank, step)).pow(2).mean().backward()
        opt.step()
    buf = _flat(opt.state[p]["momentum_buffer"] for p in model.parameters())
    u = last_update_dense(state, model.module)
    return float((buf - u).abs().max() / u.abs().max()), state.step


@pytest.mark.parametrize("static_graph", [False, True])
def test_no_sync_accumulation_keeps_the_buffer_equal_to_what_was_sent(static_graph):
    for gap, steps in run_distributed(_no_sync, 2, static_graph):
        assert steps == 6 and gap < 1e-5


@pytest.mark.parametrize("kwargs,pattern", [
    ({"nesterov": True}, r"nesterov=True, dampening=0.*use nesterov=False and dampening=0, or .*'steps'"),
    ({"dampening": 0.1}, r"nesterov=False, dampening=0.1"),
])
def test_nesterov_and_dampening_are_refused_with_what_to_do(kwargs, pattern):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1, momentum=0.9, **kwargs)
    with pytest.raises(ValueError, match=pattern):
        check_optimizer(SparsifyState(method="randomk"), opt)
    with pytest.warns(UserWarning, match="known to diverge"):  # as it is: allowed, with the known hazard named
        check_optimizer(SparsifyState(method="randomk", optimizer_momentum="steps"), opt)


def _adam(rank, world):
    model = DDP(_model())
    state = SparsifyState(**OPTIONS)
    model.register_comm_hook(state, sparsify_hook)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for step in range(4):
        opt.zero_grad()
        model(_batch(rank, step)).pow(2).mean().backward()
        opt.step()
    return state.send_momentum(((0, 0, 1),), torch.device("cpu")), torch.isfinite(_flat(model.parameters())).all()


def test_other_optimizers_get_the_averaged_gradient_as_it_is():
    for momentum, finite in run_distributed(_adam, 2):
        assert momentum is None and finite  # Adam seen: no velocity in the hook


def test_optimizer_momentum_choices_are_checked():
    with pytest.raises(ValueError, match=r"`optimizer_momentum` must be one of 'auto', 'sends', 'steps', got 'x'"):
        SparsifyState(optimizer_momentum="x")
    with pytest.raises(ValueError, match=r"`optimizer_momentum`='sends' needs `momentum`=0"):
        SparsifyState(optimizer_momentum="sends", momentum=0.9)
    assert SparsifyState(method="random_block").counts_momentum_in_sends
    assert SparsifyState(method="topk", aggregation="allgather").counts_momentum_in_sends
    assert not SparsifyState(method="randomk", error_feedback=False).counts_momentum_in_sends
    assert not SparsifyState(method="topk", aggregation="allgather", optimizer_momentum="steps").counts_momentum_in_sends


def _resume_without_momentum(rank, world, tmp, adam):
    def build():
        model = DDP(_model())
        state = SparsifyState(**OPTIONS)
        model.register_comm_hook(state, sparsify_hook)
        opt = (torch.optim.Adam(model.parameters(), lr=1e-3) if adam
               else torch.optim.SGD(model.parameters(), lr=0.05))
        return model, state, opt

    model, state, opt = build()
    for step in range(3):
        opt.zero_grad()
        model(_batch(rank, step)).pow(2).mean().backward()
        opt.step()
    saved = state.state_dict()
    assert not saved["velocities"]  # no momentum to count: no velocity kept or saved
    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "hook": saved}, f"{tmp}/r{rank}.pt")
    model, state, opt = build()
    ck = torch.load(f"{tmp}/r{rank}.pt", weights_only=True)
    model.module.load_state_dict(ck["model"])
    opt.load_state_dict(ck["opt"])
    state.load_state_dict(ck["hook"])
    for step in range(3, 5):
        opt.zero_grad()
        model(_batch(rank, step)).pow(2).mean().backward()
        opt.step()
    return state.step


@pytest.mark.parametrize("adam", [True, False])
def test_resume_with_an_optimizer_without_momentum(tmp_path, adam):
    assert run_distributed(_resume_without_momentum, 2, str(tmp_path), adam) == [5, 5]


def test_weight_decay_in_the_hook_does_not_count_the_optimizers_momentum():
    # weight decay in the hook belongs to the hook's own momentum pairing; counting SGD's momentum as well
    # would apply it twice during a dense warm-up
    assert not SparsifyState(method="randomk", weight_decay=5e-4).counts_momentum_in_sends
    with pytest.raises(ValueError, match=r"`optimizer_momentum`='sends' needs `momentum`=0, `weight_decay`=0"):
        SparsifyState(method="randomk", weight_decay=5e-4, optimizer_momentum="sends")

"""Single-process checks of Local AdaAlter: validation, references, schedule, checkpoints."""

import io

import pytest
import torch
import torch.distributed as dist

from ddp_hooks.adaalter import AdaAlterAverager, LocalAdaAlter, LocalAdaAlterSchedule, LocalSGDState, OuterSGD


def _grads(n_steps, shape=(3, 2), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(n_steps)]


def _start(seed=100):
    """The parameters' first values, from a generator of their own: the global one's state depends on the tests
    run before (hypothesis draws a varying number), and a float32 comparison at rtol 1e-6 should not."""
    return torch.randn(3, 2, generator=torch.Generator().manual_seed(seed))


def _one_worker_reference(x0, grads, lr, eps, period, warmup, lazy=True, outer=None):
    """Algorithm 2 of arXiv 1911.09030 for one worker, written out step by step.

    ``lazy``: True/"paper" ``(t - t0) eps^2``, False/"constant" ``eps^2``, "rate" ``eps^2 + (t - t0 - 1) r``
    with ``r`` the last growth of ``b2`` per step; ``outer``: ``(lr, momentum, nesterov)`` applied at each
    averaging from the parameters of the last synchronisation (at the first: where the local steps began).
    """
    rule = {True: "paper", False: "constant"}.get(lazy, lazy)
    x, b2, a, t0 = x0.clone(), torch.zeros_like(x0), torch.zeros_like(x0), 0
    r, anchor, v = torch.zeros_like(x0), None, torch.zeros_like(x0)
    for t, g in enumerate(grads, start=1):
        if t <= warmup:
            x = x - lr * g / torch.sqrt(b2 + eps ** 2)
            b2, r = b2 + g * g, g * g
            t0 = t
            continue
        if outer is not None and anchor is None:  # the first local round starts here
            anchor = x.clone()
        if rule == "rate":
            denom = b2 + eps ** 2 + (t - t0 - 1) * r
        else:
            denom = b2 + ((t - t0) if rule == "paper" else 1) * eps ** 2
        x = x - lr * g / torch.sqrt(denom)
        a = a + g * g
        if t - t0 == period:
            if outer is not None:
                olr, m, nesterov = outer
                d = anchor - x
                v = m * v + d
                x = anchor - olr * ((d + m * v) if nesterov else v)
                anchor = x.clone()
            b2, r, a, t0 = b2 + a, a / period, torch.zeros_like(a), t
    return x, b2, a


def _run_opt(x0, grads, **kw):
    w = torch.nn.Parameter(x0.clone())
    opt = LocalAdaAlter([w], **kw)
    for g in grads:
        w.grad = g.clone()
        opt.step()
    return w.detach(), opt


def test_validation_names_argument_value_and_rule():
    w = [torch.nn.Parameter(torch.zeros(2))]
    cases = [
        (dict(lr=0.0), ValueError, r"`lr` must be a float in \(0, inf\), got 0.0; it is the learning rate"),
        (dict(lr="1"), TypeError, r"`lr` must be a float, got '1' of type str"),
        (dict(eps=-1.0), ValueError, r"`eps` must be a float in \(0, inf\), got -1.0; eps\^2 is the initial"),
        (dict(eps=float("nan")), ValueError, r"`eps` must be a float in \(0, inf\), got nan"),
        (dict(period=0), ValueError,
         r"`period` must be an int >= 1, got 0; it is the number of local steps between averagings"),
        (dict(period=2.0), TypeError, r"`period` must be an int, got 2.0 of type float"),
        (dict(warmup_steps=-3), ValueError, r"`warmup_steps` must be an int >= 0, got -3; it is the number of"),
        (dict(warmup_steps=True), TypeError, r"`warmup_steps` must be an int, got True of type bool"),
        (dict(process_group="world"), TypeError, r"`process_group` must be None \(the default group\)"),
        (dict(lazy_correction=1), TypeError, r"`lazy_correction` must be one of .* or a bool, got 1 of type int"),
        (dict(lazy_correction="lazy"), ValueError, r"`lazy_correction` must be one of"),
        (dict(outer_momentum=1.0), ValueError, r"`outer_momentum` must be a float in \[0, 1\), got 1.0"),
        (dict(outer_lr=0.0), ValueError, r"`outer_lr` must be a float in \(0, inf\), got 0.0"),
        (dict(hook_state=LocalSGDState), TypeError, r"`hook_state` must be None or a LocalSGDState, got type"),
    ]
    for kwargs, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            LocalAdaAlter(w, **kwargs)
    # None of this needed a process group: validation happens before torch.distributed is touched.
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match=r"`warmup_steps` must be an int >= 0, got -1"):
        LocalSGDState(warmup_steps=-1)
    with pytest.raises(TypeError, match=r"`schedule` must be None or a LocalAdaAlterSchedule, got int"):
        LocalSGDState(schedule=3)
    with pytest.raises(ValueError, match=r"`period` must be an int >= 1, got 0"):
        AdaAlterAverager(period=0)
    with pytest.raises(ValueError, match=r"differ from the given schedule's \(2, 1\)"):
        AdaAlterAverager(period=3, schedule=LocalAdaAlterSchedule(warmup_steps=1, period=2))


def test_single_worker_period_1_is_plain_adaalter():
    x0, grads = _start(), _grads(12)
    x, b2 = x0.clone(), torch.zeros_like(x0)
    for g in grads:  # AdaAlter: denominator from before the gradient, then accumulate
        x = x - 0.5 * g / torch.sqrt(b2 + 1.0)
        b2 = b2 + g * g
    for warmup in (0, 5):
        got, opt = _run_opt(x0, grads, lr=0.5, eps=1.0, period=1, warmup_steps=warmup)
        torch.testing.assert_close(got, x, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(opt.state[opt.param_groups[0]["params"][0]]["sum_sq"], b2)


@pytest.mark.parametrize("period,warmup,lazy,outer", [
    (4, 0, True, None), (3, 2, True, None), (5, 3, False, None), (3, 2, "rate", None), (4, 0, "rate", None),
    (3, 2, "rate", (0.7, 0.9, True)), (2, 0, "constant", (0.5, 0.6, False)), (4, 1, "paper", (1.3, 0.0, True)),
])
def test_single_worker_local_steps_match_reference(period, warmup, lazy, outer):
    x0, grads = _start(), _grads(14, seed=period)
    want_x, want_b2, want_a = _one_worker_reference(x0, grads, 0.3, 0.7, period, warmup, lazy, outer)
    options = {} if outer is None else dict(outer_lr=outer[0], outer_momentum=outer[1], outer_nesterov=outer[2])
    got, opt = _run_opt(x0, grads, lr=0.3, eps=0.7, period=period, warmup_steps=warmup, lazy_correction=lazy,
                        **options)
    st = opt.state[opt.param_groups[0]["params"][0]]
    torch.testing.assert_close(got, want_x, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(st["sum_sq"], want_b2)
    torch.testing.assert_close(st["local_sq"], want_a)
    # The rule matters: every other one gives a different trajectory, and so does dropping the outer step.
    for rule in {"paper", "constant", "rate"} - {{True: "paper", False: "constant"}.get(lazy, lazy)}:
        other, _ = _run_opt(x0, grads, lr=0.3, eps=0.7, period=period, warmup_steps=warmup, lazy_correction=rule,
                            **options)
        assert not torch.allclose(other, got)
    if outer is not None:
        plain, _ = _run_opt(x0, grads, lr=0.3, eps=0.7, period=period, warmup_steps=warmup, lazy_correction=lazy)
        assert not torch.allclose(plain, got)


def test_rule_names_and_bools_are_the_same_rules_and_old_states_load():
    x0, grads = _start(), _grads(9, seed=5)
    for flag, name in ((True, "paper"), (False, "constant")):
        by_flag, opt = _run_opt(x0, grads, lr=0.3, eps=0.7, period=3, lazy_correction=flag)
        by_name, _ = _run_opt(x0, grads, lr=0.3, eps=0.7, period=3, lazy_correction=name)
        assert torch.equal(by_flag, by_name) and opt.param_groups[0]["lazy_correction"] == name
        saved = opt.state_dict()
        saved["param_groups"][0]["lazy_correction"] = flag  # as states saved before the rules had names
        w = torch.nn.Parameter(by_flag.clone())
        fresh = LocalAdaAlter([w], lr=0.3, eps=0.7, period=3, lazy_correction="rate")
        fresh.load_state_dict(saved)
        assert fresh.param_groups[0]["lazy_correction"] == name
        w.grad = grads[0].clone()
        fresh.step()  # the loaded rule runs
        fresh.param_groups[0]["lazy_correction"] = flag  # set by hand, as code written before the names did
        fresh.step()
        assert fresh.param_groups[0]["lazy_correction"] == name


def test_param_groups_keep_their_own_rule():
    x0, grads = _start(), _grads(11, seed=8)
    a, b = torch.nn.Parameter(x0.clone()), torch.nn.Parameter(x0.clone())
    opt = LocalAdaAlter([{"params": [a], "lazy_correction": "paper"}, {"params": [b], "lazy_correction": True}],
                        lr=0.3, eps=0.7, period=3, warmup_steps=2, lazy_correction="rate")
    c = torch.nn.Parameter(x0.clone())
    opt.add_param_group({"params": [c]})  # the optimizer's default
    for g in grads:
        for p in (a, b, c):
            p.grad = g.clone()
        opt.step()
    for p, rule in ((a, "paper"), (b, "paper"), (c, "rate")):
        want, _, _ = _one_worker_reference(x0, grads, 0.3, 0.7, 3, 2, rule)
        torch.testing.assert_close(p.detach(), want, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match=r"`lazy_correction` must be one of 'paper', 'constant', 'rate', got 'Rate'"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))], "lazy_correction": "Rate"})
    assert len(opt.param_groups) == 3
    saved = opt.state_dict()
    saved["param_groups"][0]["lazy_correction"] = "Rate"
    with pytest.raises(ValueError, match="the saved param group 0 has an unknown lazy correction"):
        opt.load_state_dict({**saved, "param_groups": [{**g, "lr": 99.0} for g in saved["param_groups"]]})
    assert opt.param_groups[0]["lr"] == 0.3 and opt.param_groups[0]["lazy_correction"] == "paper"


def test_averager_state_must_match_before_anything_changes():
    w = torch.zeros(2)
    with_outer = AdaAlterAverager(period=2, outer=OuterSGD(lr=0.7))
    for _ in range(2):
        w.sub_(1.0)
        with_outer.average_parameters([w])
    saved = with_outer.state_dict()
    with pytest.raises(ValueError, match="saved with an outer optimizer and this averager has none"):
        AdaAlterAverager(period=2).load_state_dict(saved)
    with pytest.raises(ValueError, match="saved without an outer optimizer and this averager has one"):
        AdaAlterAverager(period=2, outer=OuterSGD()).load_state_dict(AdaAlterAverager(period=2).state_dict(), [w])
    other = AdaAlterAverager(period=3, outer=OuterSGD(lr=0.7))
    with pytest.raises(ValueError, match="checkpoint schedule has `period`=2"):
        other.load_state_dict(saved, [w])
    assert not other.outer.has_anchor  # refused: nothing loaded


def test_outer_state_must_match_between_checkpoint_and_optimizer():
    x0, grads = _start(), _grads(5, seed=6)
    _, with_outer = _run_opt(x0, grads, lr=0.3, period=2, outer_lr=0.7, outer_momentum=0.9)
    saved = with_outer.state_dict()
    assert [a.shape for a in saved["outer"]["anchors"]] == [(3, 2)]
    w = torch.nn.Parameter(x0.clone())
    with pytest.raises(ValueError, match=r"saved with an outer optimizer \(outer_lr=0.7, outer_momentum=0.9\)"):
        LocalAdaAlter([w], lr=0.3, period=2).load_state_dict(saved)
    with pytest.raises(ValueError, match=r"outer optimizer has lr=0.7, momentum=0.9, nesterov=True but this run "
                                         r"has lr=0.7, momentum=0.5"):
        LocalAdaAlter([w], lr=0.3, period=2, outer_lr=0.7, outer_momentum=0.5).load_state_dict(saved)
    other = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(ValueError, match="do not match the parameters' shapes"):
        LocalAdaAlter([other], lr=0.3, period=2, outer_lr=0.7, outer_momentum=0.9).load_state_dict(
            {**saved, "state": {}})


def test_parameter_without_grad_keeps_value_and_has_accumulators():
    used, unused = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.full((3,), 7.0))
    opt = LocalAdaAlter([used, unused], lr=0.5, eps=1.0, period=2)
    for _ in range(3):
        used.grad = torch.ones(2)
        opt.step()
    assert torch.equal(unused.detach(), torch.full((3,), 7.0))
    assert torch.equal(opt.state[unused]["sum_sq"], torch.zeros(3))
    assert not torch.equal(used.detach(), torch.ones(2))


def test_hook_state_warmup_mismatch_raises_and_match_shares_schedule():
    w = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match=r"built with `warmup_steps`=2 but the LocalAdaAlter schedule it is used "
                                         r"with has `warmup_steps`=3"):
        LocalAdaAlter(w, warmup_steps=3, hook_state=LocalSGDState(warmup_steps=2))
    hook = LocalSGDState(warmup_steps=3)
    opt = LocalAdaAlter(w, warmup_steps=3, period=2, hook_state=hook)
    assert hook.schedule is opt.schedule and opt.schedule.has_driver
    w[0].grad = torch.ones(2)
    opt.step()
    assert hook.schedule.step == 1 and hook.schedule.in_warmup


def test_schedule_calendar_and_checkpoint_rules():
    s = LocalAdaAlterSchedule(warmup_steps=2, period=3)
    syncs = [t for t in range(1, 12) if s.advance()]
    assert syncs == [5, 8, 11]
    s2 = LocalAdaAlterSchedule(warmup_steps=2, period=3)
    s2.load_state_dict(s.state_dict())
    assert (s2.step, s2.last_sync) == (11, 11)
    with pytest.raises(ValueError, match=r"checkpoint schedule has `period`=3 but this run was built with `period`=4"):
        LocalAdaAlterSchedule(warmup_steps=2, period=4).load_state_dict(s.state_dict())


def test_state_dicts_load_with_weights_only_and_resume_exactly():
    x0, grads = _start(), _grads(10, seed=3)
    full, _ = _run_opt(x0, grads, lr=0.5, eps=1.0, period=3, warmup_steps=2)
    half, opt = _run_opt(x0, grads[:6], lr=0.5, eps=1.0, period=3, warmup_steps=2)
    hook = LocalSGDState(warmup_steps=2, schedule=opt.schedule)
    buf = io.BytesIO()
    torch.save({"opt": opt.state_dict(), "hook": hook.state_dict(), "w": half}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    w = torch.nn.Parameter(ckpt["w"].clone())
    opt2 = LocalAdaAlter([w], lr=0.5, eps=1.0, period=3, warmup_steps=2)
    assert ckpt["opt"]["averagings"] == 0  # one process: no collective was needed
    opt2.load_state_dict({**ckpt["opt"], "averagings": 5})
    assert opt2.averager.averagings == 5
    hook2 = LocalSGDState(warmup_steps=2)
    hook2.load_state_dict(ckpt["hook"])
    assert hook2.schedule.state_dict() == opt2.schedule.state_dict() == {"warmup_steps": 2, "period": 3,
                                                                          "step": 6, "last_sync": 5}
    for g in grads[6:]:
        w.grad = g.clone()
        opt2.step()
    assert torch.equal(w.detach(), full)
    with pytest.raises(ValueError, match="no 'schedule' entry"):
        opt2.load_state_dict(torch.optim.SGD([w], lr=1.0).state_dict())


def _saved(period=3, warmup=1, steps=5, world_size=2, rank=1, shape=(3, 2)):
    """A LocalAdaAlter state dict as rank `rank` of `world_size` would have saved it after `steps` steps."""
    _, opt = _run_opt(torch.zeros(shape), _grads(steps, shape=shape), lr=0.5, eps=1.0, period=period,
                      warmup_steps=warmup)
    return {**opt.state_dict(), "world_size": world_size, "rank": rank}


def test_state_saved_between_averagings_loads_only_on_its_own_rank_and_world_size():
    sd = _saved(steps=5)  # warm-up step 1, averagings after steps 4 and 7: step 5 is between two
    assert (sd["schedule"]["step"], sd["schedule"]["last_sync"]) == (5, 4)
    fresh = LocalAdaAlter([torch.nn.Parameter(torch.zeros(3, 2))], lr=0.5, eps=1.0, period=3, warmup_steps=1)
    with pytest.raises(ValueError, match=r"saved by rank 1 of 2 between two averagings of its accumulators \(step 5, "
                                         r"last synchronised at 4\), and this is rank 0 of 1: its local accumulators "
                                         r"belong to that rank"):
        fresh.load_state_dict(sd)
    assert fresh.schedule.step == 0  # refused before anything changed
    fresh.load_state_dict({**sd, "world_size": 1, "rank": 0})  # the rank that saved it: fine
    assert fresh.schedule.step == 5


def test_accumulators_on_their_own_period_decide_where_a_state_loads():
    w = torch.nn.Parameter(torch.zeros(3, 2))
    sd = _saved(steps=4)  # warm-up step 1, period 3: step 4 averaged the parameters and the accumulators
    assert sd.pop("accumulator_period") == 3  # as saved before it existed: read as the period
    # step 4 suits H_acc = 3 but not 6
    LocalAdaAlter([w], lr=0.5, eps=1.0, period=3, warmup_steps=1).load_state_dict(sd)
    with pytest.raises(ValueError, match="averages its accumulators every 3 steps and this optimizer every 6"):
        LocalAdaAlter([w], lr=0.5, eps=1.0, period=3, warmup_steps=1, accumulator_period=6).load_state_dict(sd)
    # with H_acc = 6 step 4 averaged the parameters only: the accumulators are rank 1's own
    six = {**sd, "accumulator_period": 6}
    with pytest.raises(ValueError, match=r"rank 1 of 2 between two averagings of its accumulators \(step 4, last "
                                         r"synchronised at 4\).*averaged every 6 steps"):
        LocalAdaAlter([w], lr=0.5, eps=1.0, period=3, warmup_steps=1, accumulator_period=6).load_state_dict(six)


def test_state_saved_at_an_averaging_loads_on_any_number_of_ranks():
    for steps in (1, 4):  # a warm-up step, an averaging step: step == last_sync, all ranks hold the same state
        sd = _saved(steps=steps, world_size=4, rank=3)
        assert sd["schedule"]["step"] == sd["schedule"]["last_sync"] == steps
        fresh = LocalAdaAlter([torch.nn.Parameter(torch.zeros(3, 2))], lr=0.5, eps=1.0, period=3, warmup_steps=1)
        fresh.load_state_dict(sd)
        assert fresh.schedule.step == steps


def test_state_of_another_model_is_refused_before_anything_changes():
    sd = _saved(steps=4, shape=(3, 2))
    other = LocalAdaAlter([torch.nn.Parameter(torch.zeros(2, 3))], lr=0.5, eps=1.0, period=3, warmup_steps=1)
    with pytest.raises(ValueError, match=r"state 'sum_sq' of parameter #0 has shape \(3, 2\) but the parameter has "
                                         r"shape \(2, 3\): the state was saved from a different model"):
        other.load_state_dict(sd)
    assert other.schedule.step == 0
    two = LocalAdaAlter([torch.nn.Parameter(torch.zeros(3, 2)), torch.nn.Parameter(torch.zeros(1))], period=3,
                        warmup_steps=1)
    with pytest.raises(ValueError, match="doesn't match the size of optimizer's group"):  # torch's own check
        two.load_state_dict(sd)
    assert two.schedule.step == 0


def test_hook_state_holds_only_the_schedule_and_loads_on_any_number_of_ranks():
    hook = LocalSGDState(warmup_steps=2)
    assert set(hook.state_dict()) == {"schedule", "allreduce_calls"}  # no per-rank or per-parameter entry


def test_builders_refuse_a_model_that_is_not_ddp():
    from ddp_hooks import build_local_adaalter, build_local_sgd, build_sync_adagrad

    for build in (build_local_adaalter, build_sync_adagrad, build_local_sgd):
        with pytest.raises(TypeError, match="`ddp_model` must be a DistributedDataParallel model, got Linear"):
            build(torch.nn.Linear(2, 1))
    assert not dist.is_initialized()


def test_float16_parameters_are_refused_with_the_reason():
    with pytest.raises(TypeError, match="LocalAdaAlter got a float16 parameter: .* float16 overflows to inf at 65504"):
        LocalAdaAlter([torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))])
    opt = LocalAdaAlter([torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))])
    with pytest.raises(TypeError, match="float16 parameter"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))]})
    assert len(opt.param_groups) == 1  # the refused group was not kept

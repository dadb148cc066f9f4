"""The outer optimizer (DiLoCo / SlowMo) on its own and on AdaAlterAverager.average_parameters."""

import io

import pytest
import torch

from ddp_hooks.adaalter import AdaAlterAverager, OuterSGD
from ddp_hooks.testing import run_distributed


def test_two_rounds_of_nesterov_and_heavy_ball_by_hand():
    for nesterov in (True, False):
        outer = OuterSGD(lr=0.5, momentum=0.8, nesterov=nesterov)
        x = torch.tensor([10.0, -2.0])
        outer.set_anchor([x])
        x.copy_(torch.tensor([8.0, -1.0]))               # round 1 moved x by (-2, +1)
        outer.step_([x])
        d1 = torch.tensor([2.0, -1.0])                    # anchor - average
        v1 = d1
        want1 = torch.tensor([10.0, -2.0]) - 0.5 * ((d1 + 0.8 * v1) if nesterov else v1)
        assert torch.allclose(x, want1)
        x.sub_(torch.tensor([1.0, 1.0]))                  # round 2 moved it by (-1, -1)
        outer.step_([x])
        d2 = torch.tensor([1.0, 1.0])
        v2 = 0.8 * v1 + d2
        want2 = want1 - 0.5 * ((d2 + 0.8 * v2) if nesterov else v2)
        assert torch.allclose(x, want2)
        assert torch.equal(outer.anchors[0], x)           # the result is the next round's start


def test_lr_1_momentum_0_is_the_average_and_is_flagged_plain():
    outer = OuterSGD(lr=1.0, momentum=0.0)
    assert outer.is_plain_average and not OuterSGD().is_plain_average
    x = torch.randn(5)
    outer.set_anchor([x])
    avg = torch.randn(5)
    x.copy_(avg)
    outer.step_([x])
    torch.testing.assert_close(x, avg)


def test_misuse_is_refused_with_the_reason():
    with pytest.raises(RuntimeError, match=r"call set_anchor\(\) first"):
        OuterSGD().step_([torch.zeros(2)])
    outer = OuterSGD()
    outer.set_anchor([torch.zeros(2)])
    with pytest.raises(ValueError, match="got 2 tensors but holds 1 anchors"):
        outer.step_([torch.zeros(2), torch.zeros(1)])
    with pytest.raises(ValueError, match=r"`outer_lr` must be a float in \(0, inf\), got -1.0"):
        OuterSGD(lr=-1.0)
    with pytest.raises(TypeError, match="`outer_nesterov` must be a bool"):
        OuterSGD(nesterov=1)
    with pytest.raises(TypeError, match="`outer` must be None, an OuterSGD or a torch.optim.Optimizer, got dict"):
        AdaAlterAverager(period=2, outer={"lr": 0.7})


def _steps(averager, w, n):
    """A stand-in optimizer: w -= (step number) each step, then the averager's call."""
    out = []
    for t in range(n):
        with torch.no_grad():
            w.sub_(float(averager.schedule.step + 1))
        out.append(averager.average_parameters([w]))
    return out


def test_average_parameters_takes_the_outer_step_from_the_warmups_end_or_from_the_first_averaging():
    for warmup, calendar, want in ((1, [False, False, True, False, True], -29.0),
                                   (0, [False, True, False, True, False], -22.0)):
        w = torch.zeros(1)
        averager = AdaAlterAverager(period=2, warmup_steps=warmup, outer=OuterSGD(lr=2.0, momentum=0.0))
        assert _steps(averager, w, 5) == calendar
        # warm-up 1: -1, the start | -3 -6, doubled from -1: -1 - 2 * 5 = -11 | -15 -20, doubled: -11 - 2 * 9 = -29
        # warm-up 0: -1 -3, kept | -6 -10, doubled from -3: -3 - 2 * 7 = -17 | step 5: -17 - 5 = -22
        assert w.item() == want, (warmup, w.item())


def _ranks_run(rank, world_size):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4))
    make = lambda: AdaAlterAverager(period=2, warmup_steps=1, outer=OuterSGD(lr=0.7, momentum=0.9))  # noqa: E731
    averager = make()
    opt = torch.optim.SGD([w], lr=0.1)
    saved = None
    for t in range(7):  # the warm-up step has the same gradient on every rank, as under a synchronising hook
        g = torch.Generator().manual_seed(100 * t + (rank if t >= 1 else 0))
        w.grad = torch.randn(4, generator=g)
        opt.step()
        averager.average_parameters([w])
        if t == 3:  # mid-round (the last averaging was at step 3 of 1-based steps 1..7): keep a copy
            buffer = io.BytesIO()
            torch.save(averager.state_dict(), buffer)  # a checkpoint (state dicts hold live tensors)
            saved = (w.detach().clone(), buffer)
    final = w.detach().clone()
    with torch.no_grad():
        w.copy_(saved[0])
    resumed = make()
    saved[1].seek(0)
    resumed.load_state_dict(torch.load(saved[1], weights_only=True), [w])
    for t in range(4, 7):
        g = torch.Generator().manual_seed(100 * t + rank)
        w.grad = torch.randn(4, generator=g)
        opt.step()
        resumed.average_parameters([w])
    return final, w.detach().clone()


def test_two_ranks_agree_after_each_outer_step_and_resume_bitwise():
    (final0, resumed0), (final1, resumed1) = run_distributed(_ranks_run, 2, timeout=60)
    assert torch.equal(final0, final1)  # the last step (7) is an averaging: every rank holds the same
    assert torch.equal(final0, resumed0) and torch.equal(final1, resumed1)

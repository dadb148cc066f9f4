r"""Local AdaAlter: AdaGrad-style adaptive steps with periodic averaging (arXiv 1911.09030).

Xie, Koyejo, Gupta & Lin, "Local AdaAlter: Communication-Efficient Stochastic
Gradient Descent with Adaptive Learning Rates", 2019. Per coordinate, with
``lr`` the learning rate, ``eps`` as below, ``H = period``, worker ``i``:

1. Warm-up (synchronous AdaAlter, the paper's Algorithm 1; ``g_t`` is the
   gradient averaged by :func:`~ddp_hooks.adaalter.hook.local_sgd_hook`)::

       x_t  = x_{t-1} - lr * g_t / sqrt(B2_{t-1} + eps^2)
       B2_t = B2_{t-1} + g_t^2

2. Local steps ``t0 < t <= t0 + H`` (Algorithm 2; ``g_i,t`` the local gradient)::

       x_i = x_i - lr * g_i,t / sqrt(B2_t0 + (t - t0) * eps^2)
       A_i = A_i + g_i,t^2

3. Synchronisation at ``t = t0 + H`` (one flat collective, see
   :class:`~ddp_hooks.adaalter.averager.AdaAlterAverager`)::

       x_i = mean_j x_j ;  B2_t = B2_t0 + mean_j A_j ;  A_i = 0

   With an outer optimizer (``outer_lr``, ``outer_momentum``; DiLoCo,
   arXiv 2311.08105), ``mean_j x_j`` then goes through
   :class:`~ddp_hooks.adaalter.outer_sgd.OuterSGD` from the parameters of the last
   synchronisation; the accumulators are averaged as above. At the first
   averaging that is where the local steps began (the end of the synchronous
   warm-up, or the start with ``warmup_steps=0``: the same on every rank, as
   DDP broadcasts the parameters and warm-up steps are synchronous), so the
   outer step acts from the first round on, as in DiLoCo. It moves every
   averaged parameter, one without a gradient in the round too (by its outer
   momentum), and keeps two more copies of the parameters (anchor and
   velocity, in their dtype).

Conventions:

* ``B2`` (``state["sum_sq"]``) starts at 0; the initial accumulation ``b_0^2``
  of the paper's bound belongs in ``eps``: the first denominator is
  ``sqrt(eps^2)``. The authors' ``--eps 1`` ("initial history accumulation")
  is ``eps=1.0`` here.
* The lazy correction stands in the denominator for the squared gradients
  that a synchronous run would have added since ``t0`` and a local step
  cannot know (``lazy_correction``, :mod:`ddp_hooks.adaalter.lazy_correction`):
  ``"paper"`` (``True``) ``sqrt(B2_t0 + (t - t0) * eps^2)``; ``"constant"``
  (``False``) ``sqrt(B2_t0 + eps^2)``, as the authors' MXNet code; ``"rate"``
  ``sqrt(B2_t0 + eps^2 + (t - t0 - 1) * r)``, ``r`` (``state["sq_rate"]``,
  one more tensor the size of the parameters) the accumulator's mean growth
  per step over the last round (over the last ``accumulator_period`` steps;
  with ``compress_accumulators``, the rank's own growth, since what arrives
  of the accumulators is 0 where nothing was sent).
* ``A_i`` (``state["local_sq"]``) is the rank's own sum of squared gradients
  since ``t0``. With ``H = 1`` the update of ``x`` equals synchronous AdaAlter's,
  but ``B2`` grows by ``mean_j g_j^2``, not ``(mean_j g_j)^2``.
* The schedule (steps taken, last synchronisation) is in :meth:`state_dict`,
  next to the accumulators; a resumed run is bit-identical to an unbroken one.
  Between synchronisations the ranks' parameters differ: save one checkpoint
  per rank and load the model *after* wrapping it in DDP, which broadcasts
  rank 0's parameters at construction.
* A parameter without ``.grad`` is not updated and adds nothing to ``A``, but it
  is still averaged at synchronisations (every rank sends the same tensors).
* With ``torch.amp.GradScaler`` the optimizer unscales the gradients itself,
  all ranks skip a step alike, and a skipped step does not advance the
  schedule (:mod:`ddp_hooks.adaalter.amp`).
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Iterable, Optional, Union

import torch
import torch.distributed as dist

from .._internal.collectives import world_size_and_rank
from .._internal.validation import check_bool, check_int, check_process_group
from .amp import inverse_scale, skip_step
from .averager import AdaAlterAverager
from .checkpoint import add_extra_state, load_checked
from .checks import check_positive
from .hook import LocalSGDState
from .lazy_correction import check_rule, denominator
from .outer_optimizer import OuterOptimizer
from .outer_sgd import OuterSGD, outer_settings
from .schedule import LocalAdaAlterSchedule, driver_settings, register_owner
from .sparse_average import SparseAverage, sparse_settings

__all__ = ["LocalAdaAlter"]

logger = logging.getLogger(__name__)


class LocalAdaAlter(torch.optim.Optimizer):
    """Local AdaAlter optimizer (see the module docstring for the maths).

    Args:
        params: parameters or param groups, as for any ``torch.optim`` optimizer.
        lr (float): learning rate, > 0 (the authors use 0.5).
        eps (float): > 0; ``eps^2`` is added per step to the accumulator in the
            denominator and is the initial accumulation (authors: 1).
        period (int): local steps between averagings, >= 1 (the paper's ``H``).
        warmup_steps (int): synchronous steps first, >= 0; must equal the hook's.
        process_group: the group to average in; ``None`` is the default group.
        lazy_correction (str): ``"rate"`` (default): the accumulator's own
            recent growth per step (module docstring); ``"paper"`` (also
            ``True``, the default before): the paper's ``(t - t0) * eps^2``;
            ``"constant"`` (also ``False``): the authors' constant ``eps^2``.
            Why ``"rate"``: its placeholder grows as the accumulator has been
            growing, where a fixed ``eps^2`` may be far from a model's squared
            gradients (measurements: bench/README.md, "Local AdaAlter on real data").
        outer_lr (float): > 0; the outer optimizer's learning rate (1, the
            default, with ``outer_momentum=0`` is plain averaging).
        outer_momentum (float): in [0, 1); the outer optimizer's momentum
            (0 by default; DiLoCo: ``outer_lr=0.7, outer_momentum=0.9``).
        outer_nesterov (bool): Nesterov outer momentum (default) or heavy ball.
        outer_optimizer (torch.optim.Optimizer): instead of ``outer_lr``,
            ``outer_momentum`` and ``outer_nesterov``: any optimizer built over
            the same parameters, stepped on the round's pseudo-gradient
            (:class:`~ddp_hooks.adaalter.outer_optimizer.OuterOptimizer`).
        sparse (SparseAverage): send each rank's pseudo-gradient sparsely,
            with error feedback, at each synchronisation (``None``, the
            default: the dense average of the parameters).
        accumulator_period (int): average the accumulators every this many
            steps, a multiple of ``period`` (default: ``period``).
        compress_accumulators (bool): send the accumulators through
            ``sparse`` as well (needs ``sparse``; default False: dense).
        hook_state (LocalSGDState): the hook state to share the schedule with
            (its warm-up must match); without it the hook finds this optimizer
            through the parameters at its first call.

    Example::

        >>> import torch
        >>> w = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
        >>> opt = LocalAdaAlter([w], lr=0.5, eps=1.0, period=4)
        >>> w.grad = torch.tensor([1.0, 0.0])
        >>> opt.step()
        >>> w.data, opt.state[w]["local_sq"], opt.schedule.step
        (tensor([ 0.5000, -2.0000]), tensor([1., 0.]), 1)
        >>> LocalAdaAlter([w], lr=0.5, eps=1.0, period=0)
        Traceback (most recent call last):
        ...
        ValueError: `period` must be an int >= 1, got 0; it is the number of local steps between averagings
    """

    # GradScaler calls step() even when it found inf/NaN and sets grad_scale/found_inf.
    _step_supports_amp_scaling = True

    def __init__(
        self,
        params: Iterable,
        lr: float = 0.5,
        eps: float = 1.0,
        period: int = 4,
        warmup_steps: int = 0,
        process_group: Optional[dist.ProcessGroup] = None,
        lazy_correction: Union[str, bool] = "rate",
        hook_state: Optional[LocalSGDState] = None,
        outer_lr: float = 1.0,
        outer_momentum: float = 0.0,
        outer_nesterov: bool = True,
        outer_optimizer: Optional[torch.optim.Optimizer] = None,
        sparse: Optional[SparseAverage] = None,
        accumulator_period: Optional[int] = None,
        compress_accumulators: bool = False,
    ) -> None:
        check_positive("lr", lr, "it is the learning rate")
        check_positive("eps", eps, "eps^2 is the initial accumulation; 0 would divide by zero at the first step")
        schedule = LocalAdaAlterSchedule(warmup_steps=warmup_steps, period=period)
        check_process_group("process_group", process_group)
        lazy_correction = check_rule(lazy_correction)
        outer = OuterSGD(lr=outer_lr, momentum=outer_momentum, nesterov=outer_nesterov)
        if outer_optimizer is not None:
            if not outer.is_plain_average or not outer_nesterov:
                raise ValueError(f"`outer_optimizer` was given with outer_lr={outer_lr}, outer_momentum="
                                 f"{outer_momentum}, outer_nesterov={outer_nesterov}: those build the built-in "
                                 "outer SGD; give its numbers to the optimizer instead, or leave it out")
            outer = OuterOptimizer(outer_optimizer)
        if sparse is not None and not isinstance(sparse, SparseAverage):
            raise TypeError(f"`sparse` must be None or a SparseAverage, got {type(sparse).__name__}")
        accumulator_period = period if accumulator_period is None else accumulator_period
        check_int("accumulator_period", accumulator_period, 1, "it is the number of steps between averagings of "
                  "the accumulators")
        if accumulator_period % period:
            raise ValueError(f"`accumulator_period` must be a multiple of `period`={period}, got {accumulator_period}; "
                             "the accumulators are averaged at a synchronisation of the parameters")
        check_bool("compress_accumulators", compress_accumulators, "True sends the accumulators through `sparse`")
        if compress_accumulators and sparse is None:
            raise ValueError("`compress_accumulators`=True needs `sparse`, the SparseAverage that sends them")
        if hook_state is not None and not isinstance(hook_state, LocalSGDState):
            raise TypeError(f"`hook_state` must be None or a LocalSGDState, got {type(hook_state).__name__}")
        super().__init__(params, dict(lr=float(lr), eps=float(eps), lazy_correction=lazy_correction))
        if outer_optimizer is not None:
            outer.check_params(self._params())
        if hook_state is not None:
            hook_state.attach(schedule)  # raises on a warm-up mismatch
        self.schedule = schedule
        schedule.set_driver(self._settings)
        self.averager = AdaAlterAverager(process_group=process_group, schedule=schedule,
                                         outer=None if outer.is_plain_average else outer, sparse=sparse)
        self.accumulator_period = accumulator_period
        self.compress_accumulators = compress_accumulators
        self.process_group = process_group
        self.amp_agreements = 0  # one-float allreduces issued to agree on skipping
        register_owner(self._params(), schedule)
        logger.info("LocalAdaAlter: lr=%s eps=%s period=%s warmup_steps=%s lazy_correction=%s outer_lr=%s "
                    "outer_momentum=%s outer_nesterov=%s", lr, eps, period, warmup_steps, lazy_correction,
                    outer_lr, outer_momentum, outer_nesterov)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            group["lazy_correction"] = check_rule(group["lazy_correction"])
        except (TypeError, ValueError):
            self.param_groups.pop()
            raise
        if any(p.dtype == torch.float16 for p in self.param_groups[-1]["params"]):
            self.param_groups.pop()
            raise TypeError(
                "LocalAdaAlter got a float16 parameter: its sums of squared gradients live in the parameter's "
                "dtype, and float16 overflows to inf at 65504; keep float32 parameters (autocast gives "
                "mixed precision) or use bfloat16"
            )
        # Every parameter gets its accumulators now, gradient or not, so the
        # averaging collective has the same size on every rank from the start.
        for p in self.param_groups[-1]["params"]:
            self.state[p] = {"sum_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                             "local_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
        if hasattr(self, "schedule"):
            if self.averager.sparse is not None or isinstance(self.averager.outer, OuterOptimizer):
                self.param_groups.pop()
                raise ValueError("LocalAdaAlter with `sparse` or `outer_optimizer` cannot take a parameter group "
                                 "after construction: their residuals and anchors are laid out over the "
                                 "parameters it was built with; pass every group to the constructor")
            register_owner(self.param_groups[-1]["params"], self.schedule)
            outer = self.averager.outer
            if outer is not None and outer.has_anchor:  # the anchors no longer cover every parameter
                logger.warning("LocalAdaAlter: a parameter group was added; the outer optimizer restarts (velocity "
                               "0) from where the next round begins")
                outer.anchors = outer.velocities = None

    def _params(self):
        return [p for g in self.param_groups for p in g["params"]]

    def _settings(self) -> Dict[str, Any]:
        return {**driver_settings(self.param_groups), **outer_settings(self.averager.outer),
                **sparse_settings(self.averager.sparse),
                # (as a multiple of the period, which is compared on its own: a mismatch names the period alone)
                "accumulators_every": self.accumulator_period // self.schedule.period,
                "compress_accumulators": self.compress_accumulators}

    def _check_ranks(self) -> None:
        """Before the first step's collectives: all ranks built alike? (Done by the hook when it ran first.)"""
        if not self.schedule.cross_checked:
            device = self.param_groups[0]["params"][0].device
            self.schedule.check_across_ranks(self.process_group, world_size_and_rank(self.process_group)[0], device)

    def _skip_for_amp(self, warmup: bool) -> bool:
        found_inf = getattr(self, "found_inf", None)  # set by GradScaler.step
        agree = found_inf is not None and not warmup and world_size_and_rank(self.process_group)[0] > 1
        skip = skip_step(found_inf, agree=agree, group=self.process_group)
        self.amp_agreements += int(agree)
        return skip

    @torch.no_grad()
    def step(self, closure=None):
        """Take one step; average parameters and accumulators if a synchronisation is due."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        sched = self.schedule
        for group in self.param_groups:  # a rule set on a group by hand (a name or, as before, a bool)
            group["lazy_correction"] = check_rule(group["lazy_correction"])
        self._check_ranks()
        warmup = sched.in_warmup
        if self._skip_for_amp(warmup):
            return loss  # the schedule does not advance: the step did not happen
        inv_scale = inverse_scale(getattr(self, "grad_scale", None))  # set by GradScaler.step
        local_steps = self._accumulated_steps_next()
        keeper = self.averager.anchor_keeper
        if keeper is not None and not keeper.has_anchor and not warmup and sched.local_steps_next() == 1:
            keeper.set_anchor(self._params())  # a round begins from parameters every rank shares
        for group in self.param_groups:
            lr, eps2, rule = group["lr"], group["eps"] ** 2, group["lazy_correction"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("LocalAdaAlter does not support sparse gradients")
                g = p.grad if inv_scale is None else p.grad * inv_scale.to(p.grad.dtype)
                st = self.state[p]
                denom = denominator(rule, sum_sq=st["sum_sq"], sq_rate=self._sq_rate(p) if rule == "rate" else None,
                                    eps2=eps2, local_steps=local_steps)
                p.addcdiv_(g, denom, value=-lr)
                if warmup and rule == "rate":
                    torch.mul(g, g, out=self._sq_rate(p))  # B2's growth at this step
                (st["sum_sq"] if warmup else st["local_sq"]).addcmul_(g, g)
        if sched.advance():
            self._synchronise()
        return loss

    def _accumulated_steps_next(self) -> int:
        """``t - t0`` for the next step, ``t0`` the last averaging of the accumulators: 1 in warm-up."""
        sched = self.schedule
        if sched.in_warmup or self.accumulator_period == sched.period:
            return sched.local_steps_next()
        return (sched.step - sched.warmup_steps) % self.accumulator_period + 1

    def _accumulators_due(self) -> bool:
        """At a synchronisation: are the accumulators averaged at this one?"""
        return (self.schedule.step - self.schedule.warmup_steps) % self.accumulator_period == 0

    def _sq_rate(self, p: torch.Tensor) -> torch.Tensor:
        """``r`` of the ``"rate"`` correction (made at first use, so states saved under another rule load)."""
        st = self.state[p]
        if "sq_rate" not in st:
            st["sq_rate"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return st["sq_rate"]

    def _synchronise(self) -> None:
        params = self._params()
        local = [self.state[p]["local_sq"] for p in params]
        due = self._accumulators_due()
        dense_local = local if due and not self.compress_accumulators else []
        # (after loading a state without an anchor mid-round, this averaging is dense and gives the anchor)
        self.averager.synchronise_(params, dense_local)
        if not due:
            return
        round_steps = self.accumulator_period
        rated = [p for g in self.param_groups if g["lazy_correction"] == "rate" for p in g["params"]]
        if self.compress_accumulators:
            # r from the rank's own squares, before the exchange: what arrives is 0 off the sent positions
            # and carries several rounds' squares on them
            for p in rated:
                torch.div(self.state[p]["local_sq"], round_steps, out=self._sq_rate(p))
            self.averager.sparse.mean_accumulators_(local, self.process_group)
        for group in self.param_groups:
            for p in group["params"]:
                a = self.state[p]["local_sq"]
                if group["lazy_correction"] == "rate" and not self.compress_accumulators:
                    torch.div(a, round_steps, out=self._sq_rate(p))
                self.state[p]["sum_sq"].add_(a)
                a.zero_()

    def state_dict(self) -> Dict[str, Any]:
        """Accumulators, hyperparameters, the schedule, the counters ``amp_agreements``, ``averagings``,
        and the ``world_size`` and ``rank`` that saved it."""
        return add_extra_state(super().state_dict(), self)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore accumulators and the schedule; period and warm-up must match this optimizer's.

        The rule for another number of ranks: a state saved at a
        synchronisation that averaged the accumulators (any warm-up step, or
        the step of such an averaging) is the same on every rank, and loads
        on any number of ranks and on any rank. A state saved anywhere else
        (between two synchronisations, or at one that averaged the
        parameters only, ``accumulator_period``) holds this rank's own local
        accumulators (and goes with this rank's own parameters), and with
        ``sparse`` every state after its first exchange holds this rank's
        residuals: such a state loads only on the rank that saved it, with
        the same number of ranks; anything else raises ``ValueError``.
        Accumulators whose shapes differ from the parameters' (another model),
        unknown rules and outer-optimizer mismatches raise ``ValueError``
        before anything is changed (:mod:`ddp_hooks.adaalter.checkpoint`).
        """
        load_checked(self, state_dict, super().load_state_dict)

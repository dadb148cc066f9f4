"""Average parameters and AdaAlter accumulators across ranks in one flat collective.

At a Local AdaAlter synchronisation (Xie et al. 2019, arXiv 1911.09030,
Algorithm 2: ``x = mean_j x_j``, ``B2 = B2_t0 + mean_j A_j``) every rank
sends its parameters and its local accumulators. Many small allreduces cost
one network latency each, so :meth:`AdaAlterAverager.average_` packs all
tensors into one buffer (of their promoted dtype), divides it by the world
size *before* the collective (so half-precision sums cannot overflow, as
PyTorch's ``allreduce_hook`` does), runs one allreduce and copies the slices
back in place.

Every rank must pass the same list of tensors in the same order, whether or
not a parameter received a gradient this step: the collective's size then
never depends on which parameters were used, so it cannot deadlock.

With an outer optimizer (:class:`~ddp_hooks.adaalter.outer_sgd.OuterSGD`, DiLoCo's and
SlowMo's), the averaged parameters are then replaced by an outer SGD step
from the parameters of the last synchronisation; the accumulators are
averaged as before.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Union

import torch
import torch.distributed as dist

from .._internal.collectives import check_same_on_all_ranks, world_size_and_rank
from .._internal.validation import check_process_group
from .outer_sgd import OuterSGD, outer_settings
from .schedule import LocalAdaAlterSchedule

__all__ = ["AdaAlterAverager"]


def _flatten_params(params: Iterable[Union[torch.Tensor, dict]]) -> List[torch.Tensor]:
    out: List[torch.Tensor] = []
    for item in params:
        if isinstance(item, dict):  # an optimizer's param group
            out.extend(item["params"])
        elif isinstance(item, torch.Tensor):
            out.append(item)
        else:
            raise TypeError(f"expected tensors or param-group dicts, got {type(item).__name__}")
    return out


class AdaAlterAverager:
    """Average tensors across ranks in place with one collective, optionally on a schedule.

    Args:
        period (int): steps between averagings after warm-up (>= 1); used by
            :meth:`average_parameters` only.
        warmup_steps (int): steps before the first averaging (>= 0); same.
        process_group: the group to average in; ``None`` is the default group.
        schedule (LocalAdaAlterSchedule): share an existing schedule instead
            (then ``period`` and ``warmup_steps`` must be left at their defaults
            or equal the schedule's).
        outer (OuterSGD): an outer optimizer for the averaged parameters, or
            ``None`` (plain averaging). :meth:`average_parameters` applies
            it at each averaging, from the parameters of the last
            synchronisation: at the first, those at the end of the warm-up
            (synchronous steps leave every rank the same). With
            ``warmup_steps=0`` it never sees a shared start before the first
            averaging, which then only gives the outer optimizer its start
            (call ``outer.set_anchor(params)`` before training to give it
            one). ``LocalAdaAlter`` applies it to its own averagings, from
            the first on.

    Two uses:

    * :meth:`average_` averages now (``LocalAdaAlter`` calls it with its
      parameters and local accumulators at each synchronisation);
    * :meth:`average_parameters` is a drop-in for PyTorch's
      ``PeriodicModelAverager.average_parameters``: call it after every
      optimizer step; it advances the schedule and averages when one is due.
      Its first call on several ranks checks that all ranks run the same
      schedule (one small ``all_gather``).

    ``averagings`` counts the collectives issued.

    Example::

        >>> import torch
        >>> avg = AdaAlterAverager(period=2)
        >>> w = torch.ones(3)
        >>> [avg.average_parameters([w]) for _ in range(4)]
        [False, True, False, True]
        >>> avg.averagings  # a single process needs no collective
        0
    """

    def __init__(
        self,
        period: int = 1,
        warmup_steps: int = 0,
        process_group: Optional[dist.ProcessGroup] = None,
        schedule: Optional[LocalAdaAlterSchedule] = None,
        outer: Optional[OuterSGD] = None,
    ) -> None:
        own = LocalAdaAlterSchedule(warmup_steps=warmup_steps, period=period)  # validates both
        check_process_group("process_group", process_group)
        if schedule is None:
            schedule = own
        elif not isinstance(schedule, LocalAdaAlterSchedule):
            raise TypeError(f"`schedule` must be None or a LocalAdaAlterSchedule, got {type(schedule).__name__}")
        elif (period, warmup_steps) not in ((1, 0), (schedule.period, schedule.warmup_steps)):
            raise ValueError(
                f"`period`={period}, `warmup_steps`={warmup_steps} differ from the given schedule's "
                f"({schedule.period}, {schedule.warmup_steps}); pass only the schedule"
            )
        if outer is not None and not isinstance(outer, OuterSGD):
            raise TypeError(f"`outer` must be None or an OuterSGD, got {type(outer).__name__}")
        self.schedule = schedule
        self.process_group = process_group
        self.outer = outer
        self.averagings = 0
        self._outer_checked = False

    @torch.no_grad()
    def average_(self, tensors: List[torch.Tensor]) -> None:
        """Replace each tensor by its mean across ranks, in one allreduce.

        All tensors must be dense and on one device; integer tensors are not
        averaged meaningfully and are rejected.
        """
        world, _ = world_size_and_rank(self.process_group)
        if world == 1 or not tensors:
            return
        dtype = tensors[0].dtype
        for t in tensors:
            if not t.is_floating_point():
                raise TypeError(f"can only average floating-point tensors, got {t.dtype}")
            dtype = torch.promote_types(dtype, t.dtype)
        flat = torch.cat([t.detach().reshape(-1).to(dtype) for t in tensors])
        flat.div_(world)
        dist.all_reduce(flat, group=self.process_group)
        self.averagings += 1
        offset = 0
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset:offset + n].view_as(t))
            offset += n

    def average_parameters(self, params: Iterable[Union[torch.Tensor, dict]]) -> bool:
        """Advance the schedule by one step; average ``params`` if a synchronisation is due.

        Args:
            params: tensors, or an optimizer's ``param_groups``.

        Returns:
            Whether this call ended with an averaging (also on a single rank).
        """
        params = _flatten_params(params)
        world, _ = world_size_and_rank(self.process_group)
        if world > 1 and params:  # before the first averaging: do all ranks average on the same steps?
            self.schedule.check_across_ranks(self.process_group, world, params[0].device)
            self._check_outer_across_ranks(world, params[0].device)
        due = self.schedule.advance()
        outer = self.outer if self.outer is not None and not self.outer.is_plain_average else None
        if due:
            self.average_(params)
            if outer is not None:
                outer.apply_(params)
        elif outer is not None and not outer.has_anchor and self.schedule.step == self.schedule.warmup_steps:
            outer.set_anchor(params)  # the warm-up's end: every rank holds the same parameters
        return due

    def _check_outer_across_ranks(self, world: int, device) -> None:
        """Once: ranks with different outer optimizers would leave the average at different places."""
        if self._outer_checked:
            return
        settings = {"outer": self.outer is not None, **outer_settings(self.outer)}
        check_same_on_all_ranks(settings, self.process_group, world, device, "outer optimizers",
                                "every rank must take the same outer step from the same average")
        self._outer_checked = True

    def state_dict(self) -> Dict[str, object]:
        """The schedule, the counter and the outer optimizer's state, if any."""
        state = {"schedule": self.schedule.state_dict(), "averagings": self.averagings}
        if self.outer is not None:
            state["outer"] = self.outer.state_dict()
        return state

    def load_state_dict(self, state: Dict, params: Optional[Iterable[Union[torch.Tensor, dict]]] = None) -> None:
        """Restore what :meth:`state_dict` returned (with an outer optimizer: pass the ``params`` averaged)."""
        if ("outer" in state) != (self.outer is not None):
            saved, mine = ("with" if "outer" in state else "without"), ("has one" if self.outer else "has none")
            raise ValueError(f"the averager state was saved {saved} an outer optimizer and this averager {mine}; "
                             "build it as it was saved to resume")
        if self.outer is not None and params is None:
            raise ValueError("an averager with an outer optimizer needs `params` to load its state "
                             "(the anchors take their shapes and devices)")
        check = LocalAdaAlterSchedule(warmup_steps=self.schedule.warmup_steps, period=self.schedule.period)
        check.load_state_dict(state["schedule"])  # validated on a copy: a refused state changes nothing
        if self.outer is not None:
            self.outer.load_state_dict(state["outer"], _flatten_params(params))
        self.schedule.load_state_dict(state["schedule"])
        self.averagings = int(state["averagings"])

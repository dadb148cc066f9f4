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
SlowMo's, or any ``torch.optim`` optimizer through
:class:`~ddp_hooks.adaalter.outer_optimizer.OuterOptimizer`), the averaged
parameters are then replaced by an outer step from the parameters of the
last synchronisation (the *anchor*); the accumulators are averaged as
before. With a :class:`~ddp_hooks.adaalter.sparse_average.SparseAverage`
the parameters are not sent: each rank sends its pseudo-gradient ``x_a - x``
sparsely, with error feedback (:meth:`AdaAlterAverager.synchronise_`).
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Union

import torch
import torch.distributed as dist

from .._internal.collectives import check_same_on_all_ranks, world_size_and_rank
from .._internal.validation import check_process_group
from .outer_optimizer import OuterOptimizer
from .outer_sgd import OuterSGD, outer_settings
from .schedule import LocalAdaAlterSchedule
from .sparse_average import SparseAverage, sparse_settings

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
        outer (OuterSGD or torch.optim.Optimizer): an outer optimizer for
            the averaged parameters, or ``None`` (plain averaging); a
            ``torch.optim`` optimizer is built over the averaged parameters
            (:class:`~ddp_hooks.adaalter.outer_optimizer.OuterOptimizer`). :meth:`average_parameters` applies
            it at each averaging, from the parameters of the last
            synchronisation: at the first, those at the end of the warm-up
            (synchronous steps leave every rank the same). With
            ``warmup_steps=0`` it never sees a shared start before the first
            averaging, which then only gives the outer optimizer its start
            (call ``outer.set_anchor(params)`` before training to give it
            one). ``LocalAdaAlter`` applies it to its own averagings, from
            the first on.
        sparse (SparseAverage): send each rank's pseudo-gradient sparsely,
            with error feedback, instead of its parameters (``None``: dense).
            It needs an anchor as the outer optimizer does; an averaging
            without one is dense and gives it one.

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
        outer: Union[None, OuterSGD, OuterOptimizer, torch.optim.Optimizer] = None,
        sparse: Optional[SparseAverage] = None,
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
        if isinstance(outer, torch.optim.Optimizer):
            outer = OuterOptimizer(outer)
        if outer is not None and not isinstance(outer, (OuterSGD, OuterOptimizer)):
            raise TypeError(f"`outer` must be None, an OuterSGD or a torch.optim.Optimizer, got {type(outer).__name__}")
        if sparse is not None and not isinstance(sparse, SparseAverage):
            raise TypeError(f"`sparse` must be None or a SparseAverage, got {type(sparse).__name__}")
        self.schedule = schedule
        self.process_group = process_group
        self.outer = outer
        self.sparse = sparse
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

    @property
    def anchor_keeper(self):
        """Who holds the round's starting point: the outer optimizer, else the sparse averaging, else nobody."""
        outer = self.stepping_outer
        return outer if outer is not None else self.sparse

    @property
    def stepping_outer(self):
        """The outer optimizer, unless it is none or plain averaging (which is then skipped, bit for bit)."""
        return None if self.outer is None or self.outer.is_plain_average else self.outer

    @torch.no_grad()
    def synchronise_(self, params: List[torch.Tensor], extra: List[torch.Tensor] = ()) -> None:
        """One synchronisation: average ``params`` (sparsely where asked) and ``extra`` (densely), then the
        outer step.

        Sparse: ``x = x_a - mean_j c_j`` (:class:`SparseAverage`), ``extra``
        in its own allreduce. Without an anchor yet (the first averaging of
        a run whose local steps began without one) ``params`` and ``extra``
        are averaged densely, in one allreduce, and that average is the anchor.
        """
        keeper = self.anchor_keeper
        if self.sparse is None or not keeper.has_anchor:
            self.average_(list(params) + list(extra))
        else:
            self.sparse.average_(params, keeper.anchors, self.process_group)
            self.averagings += 1
            self.average_(list(extra))
        if self.stepping_outer is not None:
            self.outer.apply_(params)
        elif self.sparse is not None:
            self.sparse.set_anchor(params)

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
        keeper = self.anchor_keeper
        if due:
            self.synchronise_(params)
        elif keeper is not None and not keeper.has_anchor and self.schedule.step == self.schedule.warmup_steps:
            keeper.set_anchor(params)  # the warm-up's end: every rank holds the same parameters
        return due

    def _check_outer_across_ranks(self, world: int, device) -> None:
        """Once: ranks with different outer optimizers would leave the average at different places."""
        if self._outer_checked:
            return
        settings = {"outer": self.outer is not None, **outer_settings(self.outer), **sparse_settings(self.sparse)}
        check_same_on_all_ranks(settings, self.process_group, world, device, "outer optimizers",
                                "every rank must take the same outer step from the same average")
        self._outer_checked = True

    def state_dict(self) -> Dict[str, object]:
        """The schedule, the counter and the outer optimizer's state, if any."""
        state = {"schedule": self.schedule.state_dict(), "averagings": self.averagings}
        if self.outer is not None:
            state["outer"] = self.outer.state_dict()
        if self.sparse is not None:
            state["sparse"] = self.sparse.state_dict(self.process_group)
        return state

    def load_state_dict(self, state: Dict, params: Optional[Iterable[Union[torch.Tensor, dict]]] = None) -> None:
        """Restore what :meth:`state_dict` returned (with an outer optimizer: pass the ``params`` averaged)."""
        if ("outer" in state) != (self.outer is not None):
            saved, mine = ("with" if "outer" in state else "without"), ("has one" if self.outer else "has none")
            raise ValueError(f"the averager state was saved {saved} an outer optimizer and this averager {mine}; "
                             "build it as it was saved to resume")
        if ("sparse" in state) != (self.sparse is not None):
            saved, mine = ("with" if "sparse" in state else "without"), ("has one" if self.sparse else "has none")
            raise ValueError(f"the averager state was saved {saved} a sparse averaging and this averager {mine}; "
                             "build it as it was saved to resume")
        if (self.outer is not None or self.sparse is not None) and params is None:
            raise ValueError("an averager with an outer optimizer or a sparse averaging needs `params` to load its "
                             "state (the anchors take their shapes and devices)")
        params = None if params is None else _flatten_params(params)
        check = LocalAdaAlterSchedule(warmup_steps=self.schedule.warmup_steps, period=self.schedule.period)
        check.load_state_dict(state["schedule"])  # validated on a copy: a refused state changes nothing
        if self.sparse is not None:
            self.sparse.check_loadable(state["sparse"], params, self.process_group)
        if self.outer is not None:
            self.outer.check_loadable(state["outer"], params)
        if self.outer is not None:
            self.outer.load_state_dict(state["outer"], params)
        if self.sparse is not None:
            self.sparse.load_state_dict(state["sparse"], params, self.process_group)
        self.schedule.load_state_dict(state["schedule"])
        self.averagings = int(state["averagings"])

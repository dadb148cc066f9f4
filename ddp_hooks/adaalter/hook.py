"""The comm hook of Local AdaAlter: allreduce gradients during warm-up, nothing afterwards.

Local AdaAlter (Xie, Koyejo, Gupta & Lin, 2019, arXiv 1911.09030; the
authors' code warms up synchronously) runs in two phases:

1. warm-up, steps ``t <= warmup_steps``: the hook averages each gradient
   bucket across ranks (divide by the world size, then allreduce), so the
   optimizer performs synchronous AdaAlter on the averaged gradient;
2. local steps: the hook returns the bucket untouched (a completed future, no
   traffic); the optimizer averages parameters and accumulators every
   ``period`` steps (:class:`~ddp_hooks.adaalter.averager.AdaAlterAverager`).

The hook never counts steps itself when a
:class:`~ddp_hooks.adaalter.optimizer.LocalAdaAlter` optimizer owns the bucket's
parameters: it reads that optimizer's :class:`~ddp_hooks.adaalter.schedule.LocalAdaAlterSchedule`,
which only advances on steps really taken. A step skipped by ``GradScaler``
therefore leaves the hook in the same phase for the next backward (unlike
PyTorch's ``post_localSGD_hook``, issue 76282). Only without such an optimizer
(e.g. plain SGD with a model averager) does the hook fall back to counting
backward passes on the last bucket, as PyTorch does.

At its first call the hook checks that a process group exists and that its
backend moves the gradients' device, refuses a bucket cast by a compression
wrapper, and compares the schedule (and the optimizer's numbers) across ranks
with one small ``all_gather``
(:meth:`~ddp_hooks.adaalter.schedule.LocalAdaAlterSchedule.check_across_ranks`), so
that mismatched ranks fail alike instead of averaging on different steps.
"""

# No `from __future__ import annotations` here: DDP compares the hook's
# annotations with dist.GradBucket and Future as objects, not strings.
import logging
from typing import Dict, Optional

import torch
import torch.distributed as dist

from .._internal.validation import check_group_ready, check_hook_call, check_int, check_process_group
from .._internal.collectives import allreduce_mean, completed_future
from .schedule import LocalAdaAlterSchedule, find_owner

__all__ = ["LocalSGDState", "local_sgd_hook"]

logger = logging.getLogger(__name__)


class LocalSGDState:
    """State of :func:`local_sgd_hook`: the process group, the shared schedule, counters.

    Args:
        process_group: the group to average gradients in; ``None`` is the default group.
        warmup_steps (int): synchronous steps before local steps start, >= 0.
            It must equal the optimizer's; a mismatch raises ``ValueError`` at
            the latest on the first backward after both exist.
        schedule (LocalAdaAlterSchedule): share this schedule instead of
            making one (``warmup_steps`` may then be omitted).

    The schedule is part of :meth:`state_dict` so that a resumed run neither
    repeats warm-up steps nor averages on shifted steps.

    Example::

        >>> state = LocalSGDState(warmup_steps=2)
        >>> state.schedule.in_warmup, state.allreduce_calls
        (True, 0)
        >>> LocalSGDState(warmup_steps=-1)
        Traceback (most recent call last):
        ...
        ValueError: `warmup_steps` must be an int >= 0, got -1; it is the number of synchronous steps ...
    """

    __slots__ = (
        # options
        "process_group",
        # the step counter, shared with (and advanced by) the optimizer
        "schedule",
        # counters: gradient allreduces issued (one per bucket per warm-up step)
        "allreduce_calls",
        # bound at the first hook call
        "_group", "_world_size",
    )

    def __init__(
        self,
        process_group: Optional[dist.ProcessGroup] = None,
        warmup_steps: Optional[int] = None,
        schedule: Optional[LocalAdaAlterSchedule] = None,
    ) -> None:
        check_process_group("process_group", process_group)
        if schedule is not None and not isinstance(schedule, LocalAdaAlterSchedule):
            raise TypeError(f"`schedule` must be None or a LocalAdaAlterSchedule, got {type(schedule).__name__}")
        if warmup_steps is not None:
            check_int("warmup_steps", warmup_steps, 0, "it is the number of synchronous steps before local steps start")
        if schedule is None:
            schedule = LocalAdaAlterSchedule(warmup_steps=0 if warmup_steps is None else warmup_steps, period=None)
        elif warmup_steps is not None:
            schedule.check_same_warmup(warmup_steps, "LocalSGDState")
        self.process_group = process_group
        self.schedule = schedule
        self.allreduce_calls = 0
        self._group = None
        self._world_size: Optional[int] = None

    def attach(self, schedule: LocalAdaAlterSchedule) -> None:
        """Use the optimizer's ``schedule`` from now on (checks that both agree)."""
        if schedule is self.schedule:
            return
        schedule.check_same_warmup(self.schedule.warmup_steps, "LocalSGDState")
        if self.schedule.step != schedule.step:
            raise ValueError(
                f"LocalSGDState is at step {self.schedule.step} but the optimizer's schedule is at step "
                f"{schedule.step}; were they loaded from different checkpoints?"
            )
        self.schedule = schedule

    def _bind(self, bucket: dist.GradBucket) -> None:
        """At the first call: the process group (present, right backend) and the schedule's cross-rank check."""
        device = bucket.buffer().device
        dtypes = {p.dtype for p in bucket.parameters()}
        if bucket.buffer().dtype not in dtypes:
            raise TypeError(
                f"local_sgd_hook received a {bucket.buffer().dtype} bucket for {sorted(map(str, dtypes))} "
                "parameters: a wrapper such as fp16_compress_wrapper cast it. After warm-up nothing is sent, so the "
                "cast would only round the local gradients; register local_sgd_hook without a compression wrapper"
            )
        if self._world_size is None:
            self._group = check_group_ready(self.process_group, device, "local_sgd_hook")
            self._world_size = dist.get_world_size(self._group)
        self.schedule.check_across_ranks(self._group, self._world_size, device)

    def state_dict(self) -> Dict[str, int]:
        """Schedule and counters as plain ints (``torch.load(weights_only=True)`` safe).

        The same on every rank, so it loads on any number of ranks.
        """
        return {"schedule": self.schedule.state_dict(), "allreduce_calls": self.allreduce_calls}

    def load_state_dict(self, state: Dict) -> None:
        """Restore what :meth:`state_dict` returned (into the shared schedule)."""
        self.schedule.load_state_dict(state["schedule"])
        self.allreduce_calls = int(state["allreduce_calls"])

    def __getstate__(self):
        # A process group cannot be pickled; a restored state uses the default group.
        return {"schedule": self.schedule.state_dict(), "allreduce_calls": self.allreduce_calls}

    def __setstate__(self, state):
        sched = state["schedule"]
        schedule = LocalAdaAlterSchedule(warmup_steps=sched["warmup_steps"], period=sched["period"] or None)
        self.__init__(None, schedule=schedule)
        self.load_state_dict(state)


def local_sgd_hook(state: LocalSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket across ranks during warm-up; leave it local afterwards.

    Register with ``ddp_model.register_comm_hook(state, local_sgd_hook)``.
    The phase is read from ``state.schedule`` (see the module docstring).

    Args:
        state (LocalSGDState): the hook state.
        bucket (dist.GradBucket): DDP's flat gradient bucket.

    Returns:
        A future holding ``bucket.buffer()``, averaged in place during warm-up.
    """
    check_hook_call("local_sgd_hook", state, LocalSGDState, bucket)
    sched = state.schedule
    if not sched.has_driver:
        owner = find_owner(bucket.parameters())
        if owner is not None:
            state.attach(owner)  # raises on a warm-up mismatch, before any step
            sched = owner
    if state._world_size is None or not sched.cross_checked:
        state._bind(bucket)
    warmup = sched.in_warmup
    if not sched.has_driver and bucket.is_last():
        sched.advance()  # fallback: no optimizer drives the schedule
    buffer = bucket.buffer()
    if not warmup:
        return completed_future(buffer)
    state.allreduce_calls += 1
    return allreduce_mean(buffer, state._group, state._world_size)

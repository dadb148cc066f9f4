"""Baselines that Local AdaAlter is benchmarked against, built from PyTorch's own parts.

* :func:`build_sync_adagrad`: synchronous AdaGrad, i.e. PyTorch's
  ``allreduce_hook`` (gradients averaged every step) with ``torch.optim.Adagrad``.
  Note that AdaGrad divides by the accumulator *including* the current
  gradient, ``x -= lr * g_t / (sqrt(b0^2 + sum_{s<=t} g_s^2) + tiny)``, while
  AdaAlter (arXiv 1911.09030) divides by the one *before* it plus ``eps^2``.
  ``eps`` here sets ``initial_accumulator_value = eps^2`` so both start from
  the same denominator.
* :func:`build_local_sgd`: local SGD with PyTorch's ``post_localSGD_hook``
  (allreduce during warm-up) and ``PeriodicModelAverager`` (average the
  parameters every ``period`` steps after it). Both are given the same
  ``warmup_steps``; PyTorch's hook counts backward passes, so a step skipped
  by ``GradScaler`` shifts it against the averager (PyTorch issue 76282).
"""

# No `from __future__ import annotations`: DDP checks hook annotations as objects.
from typing import Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, post_localSGD_hook as plsgd
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

from ._internal.validation import check_float, check_int, check_process_group
from .adaalter.checks import check_ddp_model, check_positive

__all__ = ["AllreduceCounter", "counting_allreduce_hook", "build_sync_adagrad", "build_local_sgd"]


class AllreduceCounter:
    """State of :func:`counting_allreduce_hook`: the group and the number of allreduces issued."""

    __slots__ = ("process_group", "allreduce_calls")

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None) -> None:
        check_process_group("process_group", process_group)
        self.process_group = process_group
        self.allreduce_calls = 0


def counting_allreduce_hook(state: AllreduceCounter, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """PyTorch's ``allreduce_hook`` (average every bucket), counting the collectives."""
    state.allreduce_calls += 1
    return default_hooks.allreduce_hook(state.process_group, bucket)


def build_sync_adagrad(
    ddp_model: torch.nn.parallel.DistributedDataParallel,
    lr: float = 0.5,
    eps: float = 1.0,
    process_group: Optional[dist.ProcessGroup] = None,
) -> Tuple[AllreduceCounter, torch.optim.Adagrad]:
    """Register PyTorch's ``allreduce_hook`` (counted) on ``ddp_model``; return it with an Adagrad optimizer.

    Args:
        ddp_model: the DDP model.
        lr (float): learning rate, > 0.
        eps (float): > 0; the accumulator starts at ``eps^2``.
        process_group: the group to average gradients in; ``None`` is the default group.

    Example::

        >>> import os, tempfile, torch, torch.distributed as dist
        >>> dist.init_process_group("gloo", init_method="file://" + os.path.join(tempfile.mkdtemp(), "s"),
        ...                         rank=0, world_size=1)
        >>> model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))
        >>> counter, opt = build_sync_adagrad(model, lr=0.1)
        >>> model(torch.ones(1, 2)).sum().backward(); opt.step()
        >>> counter.allreduce_calls
        1
        >>> dist.destroy_process_group()
    """
    check_ddp_model(ddp_model)
    check_positive("lr", lr, "it is the learning rate")
    check_positive("eps", eps, "eps^2 is the initial accumulator value")
    check_process_group("process_group", process_group)
    counter = AllreduceCounter(process_group)
    ddp_model.register_comm_hook(counter, counting_allreduce_hook)
    return counter, torch.optim.Adagrad(ddp_model.parameters(), lr=lr, initial_accumulator_value=eps * eps, eps=1e-10)


def build_local_sgd(
    ddp_model: torch.nn.parallel.DistributedDataParallel,
    lr: float = 0.1,
    period: int = 4,
    warmup_steps: int = 0,
    momentum: float = 0.0,
    process_group: Optional[dist.ProcessGroup] = None,
) -> Tuple[plsgd.PostLocalSGDState, torch.optim.SGD, PeriodicModelAverager]:
    """Register ``post_localSGD_hook`` and build SGD plus a ``PeriodicModelAverager``.

    Call ``averager.average_parameters(ddp_model.parameters())`` after each
    ``optimizer.step()``.

    Returns:
        ``(hook_state, optimizer, averager)``.
    """
    check_ddp_model(ddp_model)
    check_positive("lr", lr, "it is the learning rate")
    check_int("period", period, 1, "it is the number of local steps between averagings")
    check_int("warmup_steps", warmup_steps, 0, "it is the number of synchronous steps before local steps start")
    check_float("momentum", momentum, 0.0, 1.0, high_open=True, reason="it is SGD's momentum factor")
    check_process_group("process_group", process_group)
    # subgroup=None with post_local_gradient_allreduce=False: no gradient
    # traffic at all after warm-up (the default would allreduce within the node).
    state = plsgd.PostLocalSGDState(process_group=process_group, subgroup=None,
                                    start_localSGD_iter=warmup_steps, post_local_gradient_allreduce=False)
    ddp_model.register_comm_hook(state, plsgd.post_localSGD_hook)
    opt = torch.optim.SGD(ddp_model.parameters(), lr=lr, momentum=momentum)
    averager = PeriodicModelAverager(period=period, warmup_steps=warmup_steps, process_group=process_group)
    return state, opt, averager

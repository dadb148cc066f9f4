"""Local AdaAlter from one set of numbers: its hook state and its optimizer, sharing one schedule."""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import torch.distributed as dist

from .checks import check_ddp_model
from .hook import LocalSGDState, local_sgd_hook
from .optimizer import LocalAdaAlter
from .sparse_average import SparseAverage

__all__ = ["build_local_adaalter"]


def build_local_adaalter(
    ddp_model: torch.nn.parallel.DistributedDataParallel,
    lr: float = 0.5,
    eps: float = 1.0,
    period: int = 4,
    warmup_steps: int = 0,
    process_group: Optional[dist.ProcessGroup] = None,
    lazy_correction: Union[str, bool] = "rate",
    outer_lr: float = 1.0,
    outer_momentum: float = 0.0,
    outer_nesterov: bool = True,
    outer_optimizer: Optional[torch.optim.Optimizer] = None,
    sparse: Optional[SparseAverage] = None,
    accumulator_period: Optional[int] = None,
    compress_accumulators: bool = False,
) -> Tuple[LocalSGDState, LocalAdaAlter]:
    """Build the hook state and the optimizer from one set of numbers; register the hook.

    The arguments are :class:`LocalAdaAlter`'s (``sparse``: a
    :class:`~ddp_hooks.adaalter.sparse_average.SparseAverage`, to send
    pseudo-gradients sparsely at each synchronisation).

    Returns:
        ``(hook_state, optimizer)`` sharing one :class:`LocalAdaAlterSchedule`.

    Example::

        >>> import os, tempfile, torch, torch.distributed as dist
        >>> store = os.path.join(tempfile.mkdtemp(), "store")
        >>> dist.init_process_group("gloo", init_method="file://" + store, rank=0, world_size=1)
        >>> model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 1))
        >>> hook_state, opt = build_local_adaalter(model, lr=0.5, eps=1.0, period=2, warmup_steps=1)
        >>> for _ in range(3):
        ...     model(torch.ones(4, 3)).sum().backward()
        ...     opt.step(); opt.zero_grad()
        >>> hook_state.allreduce_calls, hook_state.schedule is opt.schedule, opt.schedule.last_sync
        (1, True, 3)
        >>> dist.destroy_process_group()
    """
    check_ddp_model(ddp_model)
    hook_state = LocalSGDState(process_group=process_group, warmup_steps=warmup_steps)
    opt = LocalAdaAlter(ddp_model.parameters(), lr=lr, eps=eps, period=period, warmup_steps=warmup_steps,
                        process_group=process_group, lazy_correction=lazy_correction, hook_state=hook_state,
                        outer_lr=outer_lr, outer_momentum=outer_momentum, outer_nesterov=outer_nesterov,
                        outer_optimizer=outer_optimizer, sparse=sparse, accumulator_period=accumulator_period,
                        compress_accumulators=compress_accumulators)
    ddp_model.register_comm_hook(hook_state, local_sgd_hook)
    return hook_state, opt

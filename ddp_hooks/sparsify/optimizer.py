"""Momentum SGD with the sparsifying hook: the optimizer's momentum, counted in sends.

A random selector (``randomk``, ``random_block``) with error feedback sends a
coordinate about once every ``1 / density`` steps with everything it
gathered. Under SGD's own momentum that stale burst is multiplied by
``1 / (1 - momentum)`` and training diverges at the usual lr and momentum
0.9. So by default (``SparsifyState(optimizer_momentum="auto")``) the hook
reads each parameter's momentum from its ``torch.optim.SGD`` at the first
step and counts it in *sends*: it steps a velocity where a rank sends and
returns ``u_t - m u_{t-1}``, so the optimizer's buffer holds exactly the
averaged sent velocity ``u_t`` (:mod:`ddp_hooks.sparsify.hook`,
:class:`~ddp_hooks.SparsifyState`). User code keeps its optimizer, weight
decay included (dense, in the optimizer). Top-k, whose large entries leave at
once, does not diverge under the optimizer's momentum, but it trains better
with the momentum counted in sends as well (bench/README.md, "Convergence on real
images"), so the default is the same for every selector with error feedback.

Every selector also starts with a density that falls from 1 to ``density``
over its first ``density_warmup_steps`` (1000 by default): early, large and
fast-changing gradients are what delayed sends handle worst.

:func:`build_sparsify_sgd` registers the hook and builds that optimizer in one
call. Every optimizer paired with the hook is checked at its first step
(:func:`~.optimizer_check.check_optimizer`, installed by the hook's first call): momentum or
weight decay applied by both the hook (``SparsifyState(momentum=...)``) and
the optimizer is refused with ``ValueError``, as are Nesterov and dampening
where the momentum is counted in sends; the combination known to diverge
(``optimizer_momentum="steps"`` with a random selector) draws a
``UserWarning``.

Example (one process)::

    >>> import os, tempfile, torch, torch.distributed as dist
    >>> from torch.nn.parallel import DistributedDataParallel as DDP
    >>> from ddp_hooks import build_sparsify_sgd
    >>> store = os.path.join(tempfile.mkdtemp(), "store")
    >>> dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    >>> model = DDP(torch.nn.Linear(10, 2))
    >>> state, opt = build_sparsify_sgd(model, lr=0.1, momentum=0.9, weight_decay=5e-4,
    ...                                 method="random_block", density=0.05)
    >>> state.counts_momentum_in_sends, opt.defaults["momentum"], opt.defaults["weight_decay"]
    (True, 0.9, 0.0005)
    >>> model(torch.randn(4, 10)).sum().backward(); opt.step()
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

from typing import Tuple

import torch

from .._internal.validation import check_bool, check_float
from .hook import sparsify_hook
from .optimizer_check import check_optimizer
from .state import SparsifyState

__all__ = ["build_sparsify_sgd", "paired_sgd", "check_optimizer"]


def build_sparsify_sgd(
    ddp_model,
    lr: float,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    *,
    register: bool = True,
    **hook_options,
) -> Tuple[SparsifyState, torch.optim.SGD]:
    """Register :func:`~ddp_hooks.sparsify_hook` on ``ddp_model`` and return ``(state, optimizer)``.

    The optimizer is ``torch.optim.SGD(lr, momentum, weight_decay)``, exactly
    what unchanged user code builds; the hook counts its momentum in sends
    where that is the right thing (``optimizer_momentum="auto"``). Equal to
    momentum SGD at density 1.

    Args:
        ddp_model: a ``DistributedDataParallel`` model without a comm hook yet.
        lr, momentum, weight_decay (float): as for ``torch.optim.SGD``
            (heavy-ball momentum; no dampening, no Nesterov).
        register (bool): register the hook (True); False leaves that to the
            caller (``ddp_model.register_comm_hook(state, sparsify_hook)``),
            e.g. to load a checkpoint into the state first.
        **hook_options: the :class:`~ddp_hooks.SparsifyState` arguments
            (``method``, ``density``, ``scope``, ``block_size``, ...).

    Returns:
        ``(SparsifyState, torch.optim.SGD)`` over ``ddp_model.parameters()``.
    """
    check_bool("register", register, "whether to register the hook on ddp_model now")
    state = SparsifyState(**hook_options)
    optimizer = paired_sgd(state, ddp_model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    if register:
        ddp_model.register_comm_hook(state, sparsify_hook)
    return state, optimizer


def paired_sgd(state: SparsifyState, params, lr: float, momentum: float = 0.0,
               weight_decay: float = 0.0) -> torch.optim.SGD:
    """The ``torch.optim.SGD`` that pairs with ``state``, checked now rather than at its first step.

    The pairing rule, in one place (:func:`build_sparsify_sgd` and the
    recipes use it): the optimizer is what unchanged user code builds,
    ``SGD(lr, momentum, weight_decay)``; the hook counts its momentum in
    sends where that is the right thing. A state that applies momentum or
    weight decay itself needs an SGD without them: a clash is refused here
    with the ``ValueError`` of :func:`~.optimizer_check.check_optimizer`.
    """
    check_float("momentum", momentum, 0.0, 1.0, high_open=True, reason="it is SGD's heavy-ball factor")
    check_float("weight_decay", weight_decay, 0.0, float("inf"), high_open=True, reason="it is SGD's L2 penalty")
    optimizer = torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    check_optimizer(state, optimizer)
    return optimizer

"""Momentum SGD with the sparsifying hook: the optimizer's momentum, counted in sends.

A random selector (``randomk``, ``random_block``) with error feedback sends a
coordinate about once every ``1 / density`` steps with everything it
gathered. Under SGD's own momentum that stale burst is multiplied by
``1 / (1 - momentum)`` and training diverges at the usual lr and momentum
0.9. So by default (``SparsifyState(optimizer_momentum="auto")``) the hook
reads each parameter's momentum from its ``torch.optim.SGD`` at the first
step and counts it in *sends*: it steps a velocity where a rank sends and
returns ``u_t - m u_{t-1}``, so the optimizer's buffer holds exactly the
averaged sent velocity ``u_t`` (:mod:`ddp_hooks.sparsify`,
:class:`~ddp_hooks.SparsifyState`). User code keeps its optimizer, weight
decay included (dense, in the optimizer). Top-k, whose large entries leave at
once, does not diverge under the optimizer's momentum, but it trains better
with the momentum counted in sends as well (README, "Convergence on real
images"), so the default is the same for every selector with error feedback.

Every selector also starts with a density that falls from 1 to ``density``
over its first ``density_warmup_steps`` (1000 by default): early, large and
fast-changing gradients are what delayed sends handle worst.

:func:`build_sparsify_sgd` registers the hook and builds that optimizer in one
call. Every optimizer paired with the hook is checked at its first step
(:func:`check_optimizer`, installed by the hook's first call): momentum or
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

import warnings
import weakref
from typing import Tuple

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ._internal.validation import check_float
from .sparsify import sparsify_hook
from .sparsify_state import RANDOM_METHODS, SparsifyState

__all__ = ["build_sparsify_sgd", "check_optimizer", "RANDOM_METHODS"]


def build_sparsify_sgd(
    ddp_model,
    lr: float,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
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
        **hook_options: the :class:`~ddp_hooks.SparsifyState` arguments
            (``method``, ``density``, ``scope``, ``block_size``, ...).

    Returns:
        ``(SparsifyState, torch.optim.SGD)`` over ``ddp_model.parameters()``.
    """
    check_float("momentum", momentum, 0.0, 1.0, high_open=True, reason="it is SGD's heavy-ball factor")
    check_float("weight_decay", weight_decay, 0.0, float("inf"), high_open=True, reason="it is SGD's L2 penalty")
    state = SparsifyState(**hook_options)
    ddp_model.register_comm_hook(state, sparsify_hook)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    return state, optimizer


def check_optimizer(state: SparsifyState, optimizer: torch.optim.Optimizer, param_ids=None) -> None:
    """Refuse or warn about an optimizer paired with ``state`` the wrong way.

    Looks at the parameter groups holding a parameter whose ``id`` is in
    ``param_ids`` (default: every group) and reads their ``momentum`` and
    ``weight_decay`` entries (optimizers without a ``momentum`` entry, e.g.
    Adam, are not judged).

    Raises:
        ValueError: the hook applies momentum (or weight decay) and the
            optimizer does too, so it would be applied twice.

    Warns:
        UserWarning: a random selector with error feedback under the
            optimizer's momentum, the combination known to diverge at the
            usual settings; or the hook's momentum with the optimizer's weight
            decay, which is not momentum SGD with weight decay.
    """
    wanted = None if param_ids is None else set(param_ids)
    for group in optimizer.param_groups:
        if wanted is not None and not any(id(p) in wanted for p in group["params"]):
            continue
        if "momentum" not in group:
            continue
        opt_m, opt_wd = group["momentum"], group.get("weight_decay", 0.0)
        if state.momentum > 0.0 and opt_m > 0.0:
            raise ValueError(
                f"momentum would be applied twice: SparsifyState(momentum={state.momentum:g}) keeps the velocity "
                f"in the hook, and {type(optimizer).__name__} has momentum={opt_m:g}; build the optimizer with "
                "momentum=0 (ddp_hooks.build_sparsify_sgd pairs them)"
            )
        if state.weight_decay > 0.0 and opt_wd > 0.0:
            raise ValueError(
                f"weight decay would be applied twice: SparsifyState(weight_decay={state.weight_decay:g}) adds it "
                f"in the hook, and {type(optimizer).__name__} has weight_decay={opt_wd:g}; build the optimizer "
                "with weight_decay=0 (ddp_hooks.build_sparsify_sgd pairs them)"
            )
        if state.momentum > 0.0 and opt_wd > 0.0:
            warnings.warn(
                f"SparsifyState(momentum={state.momentum:g}) with the optimizer's weight_decay={opt_wd:g}: the "
                "decay skips the momentum, unlike torch.optim.SGD; pass weight_decay to SparsifyState instead",
                stacklevel=3,
            )
        if state.counts_momentum_in_sends and isinstance(optimizer, torch.optim.SGD) and opt_m > 0.0:
            if group.get("nesterov", False) or group.get("dampening", 0.0) != 0.0:
                raise ValueError(
                    f"SparsifyState(optimizer_momentum={state.optimizer_momentum!r}) counts the optimizer's momentum "
                    f"in sends, which needs plain heavy-ball SGD; this SGD has nesterov={group.get('nesterov')}, "
                    f"dampening={group.get('dampening')}: use nesterov=False and dampening=0, or keep the "
                    "optimizer's momentum as it is with SparsifyState(optimizer_momentum='steps') and a dense "
                    "warm-up (warmup_steps), or use ddp_hooks.build_sparsify_sgd"
                )
        counted = state.counts_momentum_in_sends and isinstance(optimizer, torch.optim.SGD)
        if (state.momentum == 0.0 and not counted and opt_m > 0.0 and state.error_feedback
                and state.method in RANDOM_METHODS):
            warnings.warn(
                f"method={state.method!r} with error feedback under the optimizer's momentum={opt_m:g} is known "
                "to diverge at the usual lr 0.1: coordinates leave about once every 1/density steps and momentum "
                "multiplies each delayed burst by 1/(1 - momentum); move momentum into the hook "
                "(SparsifyState(momentum=..., weight_decay=...) with SGD(momentum=0, weight_decay=0), or "
                "ddp_hooks.build_sparsify_sgd), or count it in sends: SparsifyState(optimizer_momentum='auto')",
                stacklevel=3,
            )


# Handles of watchers whose state is gone. A step pre-hook cannot remove itself (PyTorch
# iterates over the hook dict while calling them): they go at the next install.
_FINISHED: list = []


def watch_first_step(state: SparsifyState) -> None:
    """At the first step of each optimizer over parameters ``state`` has seen: :func:`check_optimizer`, and remember it.

    Installs a global ``torch.optim`` step pre-hook. For an optimizer it has
    already seen it returns at once; once the state is gone it turns into a
    no-op and is removed at the next install. The optimizers it remembers
    (weak references) are where :meth:`SparsifyState.refresh_momenta` reads
    the momentum that ``optimizer_momentum="sends"`` counts in sends.
    """
    while _FINISHED:
        _FINISHED.pop().remove()
    ref = weakref.ref(state)
    seen = weakref.WeakSet()
    done = []

    def pre_step(optimizer, args, kwargs):
        if done or optimizer in seen:
            return
        st = ref()
        if st is None:
            done.append(True)
            _FINISHED.append(handle)
            return
        keys = st._param_keys
        if not any(id(p) in keys for group in optimizer.param_groups for p in group["params"]):
            return  # another model's optimizer
        check_optimizer(st, optimizer, param_ids=keys)
        seen.add(optimizer)
        st._optimizers.append(weakref.ref(optimizer))
        st.refresh_momenta()

    handle = register_optimizer_step_pre_hook(pre_step)

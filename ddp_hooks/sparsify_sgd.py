"""Momentum SGD with the sparsifying hook: which of the pair applies momentum and weight decay.

The rule (measured in ``bench/bench_convergence.py``): with a random selector
(``randomk``, ``random_block``), error feedback and momentum > 0, momentum and
weight decay run in the hook (``SparsifyState(momentum=m, weight_decay=wd)``)
and the optimizer is plain ``torch.optim.SGD(lr)``; otherwise (top-k, no
error feedback, no momentum) they stay in the optimizer. A random selector
with error feedback under the optimizer's momentum diverges at the usual
lr 0.1, momentum 0.9: a coordinate leaves about once every ``1 / density``
steps with everything it gathered, and the optimizer multiplies that stale
burst by ``1 / (1 - momentum)`` (:class:`~ddp_hooks.SparsifyState`,
argument ``momentum``).

Random selectors should also start with a short dense warm-up
(``warmup_steps``, a few percent of the training steps): the early, large and
fast-changing gradients are what their delayed sends handle worst. In
``bench/bench_convergence.py`` (momentum 0.9, 8 seeds) two dense epochs of 40
brought random-block from 1.4 to 0.1 points below dense at density 0.05, and
from 1.5 to 0.6 at 0.01; on the recipe's ResNet-20 random-block without a
warm-up stalls near chance (README, "Momentum SGD with the sparsifier").

:func:`build_sparsify_sgd` builds a correct pair. A hand-built pair is checked
at its optimizer's first step (:func:`check_optimizer`, installed by the
hook's first call): momentum or weight decay applied by both is refused with
``ValueError``; the combination known to diverge draws a ``UserWarning``.

Example (one process)::

    >>> import os, tempfile, torch, torch.distributed as dist
    >>> from torch.nn.parallel import DistributedDataParallel as DDP
    >>> from ddp_hooks import build_sparsify_sgd
    >>> store = os.path.join(tempfile.mkdtemp(), "store")
    >>> dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    >>> model = DDP(torch.nn.Linear(10, 2))
    >>> state, opt = build_sparsify_sgd(model, lr=0.1, momentum=0.9, weight_decay=5e-4,
    ...                                 method="random_block", density=0.05)
    >>> state.momentum, state.weight_decay, opt.defaults["momentum"], opt.defaults["weight_decay"]
    (0.9, 0.0005, 0.0, 0.0)
    >>> model(torch.randn(4, 10)).sum().backward(); opt.step()
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

import inspect
import warnings
import weakref
from typing import Tuple

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ._validate import check_float
from .sparsify import sparsify_hook
from .sparsify_state import SparsifyState

__all__ = ["build_sparsify_sgd", "check_optimizer", "momentum_in_hook", "RANDOM_METHODS"]

#: Selectors whose coordinates leave at random times, regardless of their size.
RANDOM_METHODS = ("randomk", "random_block")


def momentum_in_hook(method: str, error_feedback: bool, momentum: float) -> bool:
    """True when momentum (and weight decay) belong in the hook: a random selector, error feedback, momentum > 0.

    Top-k keeps the optimizer's momentum: its large coordinates leave at
    once, so no stale burst builds up, and in ``bench/bench_convergence.py``
    it trained as well that way at densities 0.1 and 0.05, and better at 0.01.
    """
    return method in RANDOM_METHODS and bool(error_feedback) and momentum > 0.0


def build_sparsify_sgd(
    ddp_model,
    lr: float,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    **hook_options,
) -> Tuple[SparsifyState, torch.optim.SGD]:
    """Register :func:`~ddp_hooks.sparsify_hook` on ``ddp_model`` and return ``(state, optimizer)``, paired.

    The pair trains like ``torch.optim.SGD(lr, momentum, weight_decay)`` with
    sparsified gradients (equal to it at density 1); momentum and weight decay
    move into the hook when :func:`momentum_in_hook` says so.

    Args:
        ddp_model: a ``DistributedDataParallel`` model without a comm hook yet.
        lr, momentum, weight_decay (float): as for ``torch.optim.SGD``
            (heavy-ball momentum; no dampening, no Nesterov).
        **hook_options: the other :class:`~ddp_hooks.SparsifyState` arguments
            (``method``, ``density``, ``scope``, ``aggregation``,
            ``error_feedback``, ``warmup_steps``, ``seed``, ``process_group``);
            with ``randomk`` or ``random_block`` give ``warmup_steps`` a few
            percent of the training steps (see above).

    Returns:
        ``(SparsifyState, torch.optim.SGD)`` over ``ddp_model.parameters()``.
    """
    check_float("momentum", momentum, 0.0, 1.0, high_open=True, reason="it is SGD's heavy-ball factor")
    check_float("weight_decay", weight_decay, 0.0, float("inf"), high_open=True, reason="it is SGD's L2 penalty")
    defaults = {name: param.default for name, param in inspect.signature(SparsifyState).parameters.items()}
    options = {**defaults, **hook_options}
    in_hook = momentum_in_hook(options["method"], options["error_feedback"], momentum)
    state = SparsifyState(momentum=momentum if in_hook else 0.0, weight_decay=weight_decay if in_hook else 0.0,
                          **hook_options)
    ddp_model.register_comm_hook(state, sparsify_hook)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr, momentum=0.0 if in_hook else momentum,
                                weight_decay=0.0 if in_hook else weight_decay)
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
        if state.momentum == 0.0 and opt_m > 0.0 and state.error_feedback and state.method in RANDOM_METHODS:
            warnings.warn(
                f"method={state.method!r} with error feedback under the optimizer's momentum={opt_m:g} is known "
                "to diverge at the usual lr 0.1: coordinates leave about once every 1/density steps and momentum "
                "multiplies each delayed burst by 1/(1 - momentum); move momentum into the hook "
                "(SparsifyState(momentum=..., weight_decay=...) with SGD(momentum=0, weight_decay=0), or "
                "ddp_hooks.build_sparsify_sgd)",
                stacklevel=3,
            )


# Handles of watchers that are done. A step pre-hook cannot remove itself (PyTorch
# iterates over the hook dict while calling them): they go at the next install.
_FINISHED: list = []


def watch_first_step(state: SparsifyState) -> None:
    """Run :func:`check_optimizer` at the first step of an optimizer over the parameters ``state`` has seen.

    Installs a global ``torch.optim`` step pre-hook that turns into a no-op
    after that check (or once the state is gone) and is removed at the next
    install.
    """
    while _FINISHED:
        _FINISHED.pop().remove()
    ref = weakref.ref(state)
    done = []

    def pre_step(optimizer, args, kwargs):
        if done:
            return
        st = ref()
        if st is None:
            done.append(True)
            _FINISHED.append(handle)
            return
        seen = st._param_keys
        if not any(id(p) in seen for group in optimizer.param_groups for p in group["params"]):
            return  # another model's optimizer
        done.append(True)
        _FINISHED.append(handle)
        check_optimizer(st, optimizer, param_ids=seen)

    handle = register_optimizer_step_pre_hook(pre_step)

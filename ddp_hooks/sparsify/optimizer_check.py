"""The check of every optimizer paired with the sparsifying hook, at its first step.

The hook's first call installs :func:`~.momenta.watch_first_step`; at the first step
of each optimizer over the hook's parameters, :func:`check_optimizer`
refuses momentum or weight decay applied twice (by the hook and by the
optimizer), and Nesterov or dampening where the optimizer's momentum is
counted in sends, and warns about the two combinations that train far below
dense under a selector whose coordinates leave at random times: the
optimizer's momentum applied per step (known to diverge), and an adaptive
optimizer (Adam, AdamW, ...: one with a per-coordinate second moment). The
optimizer is then remembered (weakly) as the source of the momenta the hook
counts in sends (:mod:`.momenta`).

Example::

    >>> import torch
    >>> from ddp_hooks import SparsifyState
    >>> w = torch.nn.Parameter(torch.zeros(3))
    >>> check_optimizer(SparsifyState(momentum=0.9), torch.optim.SGD([w], lr=0.1, momentum=0.9))
    Traceback (most recent call last):
    ...
    ValueError: momentum would be applied twice: ...
"""

from __future__ import annotations

import warnings

import torch

__all__ = ["check_optimizer", "is_adaptive"]

# The torch.optim optimizers that divide each coordinate's step by a running measure of its own gradients.
ADAPTIVE = tuple(getattr(torch.optim, name) for name in
                 ("Adam", "AdamW", "NAdam", "RAdam", "Adamax", "Adagrad", "Adadelta", "RMSprop", "Adafactor")
                 if hasattr(torch.optim, name))


def is_adaptive(optimizer: torch.optim.Optimizer) -> bool:
    """True for an optimizer with a per-coordinate second moment: torch.optim's Adam family, Adagrad,
    Adadelta, RMSprop, Adafactor, or any optimizer whose groups have Adam's ``betas`` (LAMB, Lion, ...).

    Example::

        >>> w = torch.nn.Parameter(torch.zeros(2))
        >>> is_adaptive(torch.optim.AdamW([w])), is_adaptive(torch.optim.SGD([w], lr=0.1))
        (True, False)
    """
    return isinstance(optimizer, ADAPTIVE) or any("betas" in group for group in optimizer.param_groups)


def check_optimizer(state, optimizer: torch.optim.Optimizer, param_ids=None) -> None:
    """Refuse or warn about an optimizer paired with ``state`` the wrong way.

    ``state`` is a :class:`~ddp_hooks.SparsifyState`. Looks at the parameter
    groups holding a parameter whose ``id`` is in
    ``param_ids`` (default: every group) and reads their ``momentum`` and
    ``weight_decay`` entries (optimizers without a ``momentum`` entry, e.g.
    Adam, are not judged).

    Raises:
        ValueError: the hook applies momentum (or weight decay) and the
            optimizer does too, so it would be applied twice.

    Warns:
        UserWarning: a random selector with error feedback under the
            optimizer's momentum, the combination known to diverge at the
            usual settings; or under an adaptive optimizer, whose second
            moment the error-fed bursts inflate (measured in the README's
            "Adam and AdamW" section); or the hook's momentum with the
            optimizer's weight decay, which is not momentum SGD with weight
            decay.
    """
    wanted = None if param_ids is None else set(param_ids)
    if is_adaptive(optimizer) and state.error_feedback and state.selector.leaves_at_random_times:
        warnings.warn(
            f"method={state.method!r} with error feedback under {type(optimizer).__name__}, an adaptive optimizer: "
            "each coordinate arrives in a burst of about 1/density steps of gradient, which the optimizer's second "
            "moment counts as one large gradient, so its steps shrink and the run trains well below dense (see "
            "the README's 'Adam and AdamW' section); use method='shared_topk' (AllReduce) or method='topk' "
            "(AllGather), which send a coordinate as soon as its residual is large and lose far less under AdamW, "
            "or momentum SGD, which every selector serves",
            stacklevel=3,
        )
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
                and state.selector.leaves_at_random_times):
            warnings.warn(
                f"method={state.method!r} with error feedback under the optimizer's momentum={opt_m:g} is known "
                "to diverge at the usual lr 0.1: coordinates leave about once every 1/density steps and momentum "
                "multiplies each delayed burst by 1/(1 - momentum); move momentum into the hook "
                "(SparsifyState(momentum=..., weight_decay=...) with SGD(momentum=0, weight_decay=0), or "
                "ddp_hooks.build_sparsify_sgd), or count it in sends: SparsifyState(optimizer_momentum='auto')",
                stacklevel=3,
            )

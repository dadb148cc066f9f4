"""The momentum of each parameter's optimizer, read where the hook counts it in sends.

With ``optimizer_momentum="sends"`` (the default with error feedback) the
hook steps a velocity with each parameter's momentum ``m``. It learns ``m``
from the optimizers it sees at their first step (weak references, so the
hook never keeps an optimizer alive) and reads it again at every step's
first bucket, so a momentum schedule that changes it between steps is
followed. A ``torch.optim.SGD`` group gives its ``momentum``; other
optimizers (Adam, ...) count 0: they get the averaged gradient as it is.

Example::

    >>> import torch
    >>> w = torch.nn.Parameter(torch.zeros(2))
    >>> momenta = OptimizerMomenta()
    >>> optimizer = torch.optim.SGD([w], lr=0.1, momentum=0.9)  # (held weakly: keep a reference)
    >>> momenta.watch(optimizer)
    >>> momenta.refresh({id(w): 0})
    >>> momenta.by_key
    {0: 0.9}
"""

from __future__ import annotations

import weakref
from functools import lru_cache
from typing import Dict, List

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .optimizer_check import check_optimizer

__all__ = ["OptimizerMomenta", "velocity_runs", "velocity_momentum", "refresh_momenta", "watch_first_step"]


class OptimizerMomenta:
    """Per parameter key, the momentum of its optimizer; the optimizers seen, by weak reference."""

    __slots__ = ("by_key", "_optimizers")

    def __init__(self) -> None:
        self.by_key: Dict[int, float] = {}
        self._optimizers: List[weakref.ref] = []

    @property
    def watching(self) -> bool:
        """True once some optimizer has been seen (it may since have been freed)."""
        return bool(self._optimizers)

    def watch(self, optimizer: torch.optim.Optimizer) -> None:
        """Remember ``optimizer`` (weakly) as one to read momenta from."""
        self._optimizers.append(weakref.ref(optimizer))

    def refresh(self, keys: Dict[int, int]) -> None:
        """Read each known parameter's momentum again; ``keys`` maps ``id(parameter)`` to its key."""
        alive, momenta = [], {}
        for ref in self._optimizers:
            optimizer = ref()
            if optimizer is None:
                continue
            alive.append(ref)
            is_sgd = isinstance(optimizer, torch.optim.SGD)
            for group in optimizer.param_groups:
                m = float(group.get("momentum", 0.0)) if is_sgd else 0.0
                for p in group["params"]:
                    key = keys.get(id(p))
                    if key is not None:
                        momenta[key] = m
        self._optimizers = alive
        self.by_key = momenta

    def any_nonzero_or_unknown(self) -> bool:
        """True before any momentum was read, or while some parameter's is above 0."""
        return not self.by_key or any(m > 0.0 for m in self.by_key.values())

    def state(self) -> Dict[int, float]:
        return dict(sorted(self.by_key.items()))

    def load(self, saved: Dict[int, float]) -> None:
        self.by_key = {int(k): float(v) for k, v in saved.items()}


def velocity_runs(options, momenta: OptimizerMomenta) -> bool:
    """True while the hook keeps a velocity: its own momentum, or an optimizer momentum above 0 or not yet read.

    With the optimizer's momentum counted in sends the velocity runs from
    the first step (where no optimizer has been seen yet: its momentum is
    unknown, and a velocity stepped with 0 holds what was sent) until the
    optimizers seen turn out to have none (SGD without momentum, Adam).
    ``options`` is a :class:`~ddp_hooks.sparsify.options.SparsifyOptions`.
    """
    if options.momentum > 0.0:
        return True
    return options.counts_momentum_in_sends and momenta.any_nonzero_or_unknown()


def velocity_momentum(options, momenta: OptimizerMomenta, layout, device: torch.device):
    """The momentum the hook's velocity steps with in a bucket of ``layout``.

    ``None`` when no velocity runs (:func:`velocity_runs`); a float when
    every parameter of the bucket has the same; else a float32 tensor with
    one per parameter. With the optimizer's momentum counted in sends, a
    parameter whose optimizer has not been seen counts 0.
    """
    if options.momentum > 0.0:
        return options.momentum
    if not velocity_runs(options, momenta):
        return None
    values = tuple(momenta.by_key.get(key, 0.0) for key, _, _ in layout)
    if not values or all(m == values[0] for m in values):
        return values[0] if values else 0.0
    return _on_device(values, device)


def refresh_momenta(state) -> None:
    """Read each parameter's momentum again for ``state`` (a :class:`~ddp_hooks.SparsifyState`): at every step.

    A velocity that no momentum needs any more is dropped (it restarts at 0
    if a momentum comes back).
    """
    ran_velocity = velocity_runs(state.options, state.momenta)
    state.momenta.refresh(state.layouts.keys)
    if ran_velocity and not velocity_runs(state.options, state.momenta):
        state.compressor.velocities.load({})


@lru_cache(maxsize=256)
def _on_device(values, device: torch.device) -> torch.Tensor:
    """``values`` as a float32 tensor on ``device``, kept: a bucket's momenta repeat from step to step."""
    return torch.tensor(values, dtype=torch.float32, device=device)


# Handles of watchers whose state is gone. A step pre-hook cannot remove itself (PyTorch
# iterates over the hook dict while calling them): they go at the next install.
_FINISHED: list = []


def watch_first_step(state) -> None:
    """At the first step of each optimizer over parameters ``state`` has seen: :func:`check_optimizer`, and remember it.

    Installs a global ``torch.optim`` step pre-hook. For an optimizer it has
    already seen it returns at once; once the state is gone it turns into a
    no-op and is removed at the next install. The optimizers it remembers
    (weak references) are where :func:`refresh_momenta` reads
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
        if not st.layouts.knows_any(p for group in optimizer.param_groups for p in group["params"]):
            return  # another model's optimizer
        check_optimizer(st, optimizer, param_ids=st.layouts.keys)
        seen.add(optimizer)
        st.momenta.watch(optimizer)
        refresh_momenta(st)

    handle = register_optimizer_step_pre_hook(pre_step)

r"""The outer optimizer of local SGD: SGD with (Nesterov) momentum on the averaged pseudo-gradient.

DiLoCo (Douillard et al. 2023, arXiv 2311.08105) and SlowMo (Wang et al.,
ICLR 2020) treat the step that a round of local steps made, averaged over the
ranks, as a gradient for a second, *outer* optimizer. At each
synchronisation, with ``x_a`` the parameters after the last one (the
*anchor*, the same on every rank), ``xbar`` the new average, ``lr`` the outer
learning rate and ``m`` its momentum (the velocity ``v`` starts at 0):

.. math:: \Delta = x_a - \bar x,\quad v \leftarrow m v + \Delta,\quad
          x \leftarrow x_a - \mathrm{lr}\,(\Delta + m v)\ \text{(Nesterov)}
          \ \text{or}\ x_a - \mathrm{lr}\, v,\quad x_a \leftarrow x

Every rank computes the same numbers from the same averaged tensors, so no
collective is added. ``lr = 1`` with ``m = 0`` is plain averaging
(:attr:`OuterSGD.is_plain_average`: callers then skip it, bit for bit).

Example::

    >>> import torch
    >>> outer = OuterSGD(lr=0.5, momentum=0.0)
    >>> x = torch.tensor([4.0])
    >>> outer.set_anchor([x])         # synchronised parameters before a round
    >>> _ = x.fill_(2.0)              # the round's average moved x by -2
    >>> outer.step_([x]); x           # half of that step
    tensor([3.])
    >>> OuterSGD(lr=0.7, momentum=1.0)
    Traceback (most recent call last):
    ...
    ValueError: `outer_momentum` must be a float in [0, 1), got 1.0; it is the outer optimizer's momentum factor ...
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

from .._internal.validation import check_bool, check_float

__all__ = ["OuterSGD", "outer_settings"]


class OuterSGD:
    """SGD with momentum on the step from the last synchronised parameters to the new average.

    Args:
        lr (float): outer learning rate, > 0 (DiLoCo: 0.7). 1 with
            ``momentum=0`` is plain averaging.
        momentum (float): in [0, 1) (DiLoCo: 0.9).
        nesterov (bool): Nesterov momentum (DiLoCo), else heavy ball (SlowMo).

    The anchor and the velocity are float tensors shaped as the parameters;
    they are the same on every rank, are part of :meth:`state_dict` and so of
    the checkpoint of whoever holds this object.
    """

    __slots__ = ("lr", "momentum", "nesterov", "anchors", "velocities")

    def __init__(self, lr: float = 0.7, momentum: float = 0.9, nesterov: bool = True) -> None:
        self.lr = check_float("outer_lr", lr, 0.0, float("inf"), low_open=True, high_open=True,
                              reason="it is the outer optimizer's learning rate (1 with momentum 0 is plain averaging)")
        self.momentum = check_float("outer_momentum", momentum, 0.0, 1.0, high_open=True,
                                    reason="it is the outer optimizer's momentum factor (0 turns it off)")
        self.nesterov = check_bool("outer_nesterov", nesterov, "True: Nesterov momentum, False: heavy ball")
        self.anchors: Optional[List[torch.Tensor]] = None
        self.velocities: Optional[List[torch.Tensor]] = None

    @property
    def is_plain_average(self) -> bool:
        """Whether a step would leave the average as it is (lr 1, momentum 0)."""
        return self.lr == 1.0 and self.momentum == 0.0

    @property
    def has_anchor(self) -> bool:
        return self.anchors is not None

    @torch.no_grad()
    def set_anchor(self, params: List[torch.Tensor]) -> None:
        """Remember ``params`` (synchronised: the same on every rank) as the start of the next round."""
        self.anchors = [p.detach().clone() for p in params]
        if self.velocities is None:
            self.velocities = [torch.zeros_like(p) for p in self.anchors]

    def apply_(self, params: List[torch.Tensor]) -> None:
        """At an averaging: the outer step from the anchor, or at the first (no anchor yet) only remember
        the average, which every rank shares, as the start."""
        if self.anchors is None:
            self.set_anchor(params)
        else:
            self.step_(params)

    @torch.no_grad()
    def step_(self, params: List[torch.Tensor]) -> None:
        """Replace the averaged ``params`` by the outer step from the anchor; the result is the next anchor."""
        if self.anchors is None:
            raise RuntimeError("OuterSGD.step_() needs the round's starting point: call set_anchor() first")
        if len(params) != len(self.anchors):
            raise ValueError(f"OuterSGD got {len(params)} tensors but holds {len(self.anchors)} anchors")
        m, lr = self.momentum, self.lr
        for x, anchor, v in zip(params, self.anchors, self.velocities):
            delta = anchor.sub(x)                      # the round's averaged pseudo-gradient
            v.mul_(m).add_(delta)
            update = delta.add_(v, alpha=m) if self.nesterov else v
            x.copy_(anchor.sub_(update, alpha=lr))     # the anchor becomes the new parameters

    def state_dict(self) -> Dict[str, object]:
        """Options, anchors and velocities (lists of tensors; empty before the first anchor)."""
        return {"lr": self.lr, "momentum": self.momentum, "nesterov": self.nesterov,
                "anchors": list(self.anchors or []), "velocities": list(self.velocities or [])}

    def check_loadable(self, state: Dict[str, object], like: List[torch.Tensor]) -> None:
        """Raise ``ValueError`` unless :meth:`load_state_dict` takes ``state`` (tried on a copy)."""
        if "optimizer" in state:
            raise ValueError("the checkpoint's outer optimizer is a torch.optim optimizer and this one the built-in "
                             "OuterSGD (outer_lr, outer_momentum); build it with the saved kind to resume")
        OuterSGD(lr=self.lr, momentum=self.momentum, nesterov=self.nesterov).load_state_dict(state, like)

    def load_state_dict(self, state: Dict[str, object], like: List[torch.Tensor]) -> None:
        """Restore a :meth:`state_dict`; ``like`` are the parameters (for shapes and devices)."""
        saved = (float(state["lr"]), float(state["momentum"]), bool(state["nesterov"]))
        if saved != (self.lr, self.momentum, self.nesterov):
            raise ValueError(
                f"the checkpoint's outer optimizer has lr={saved[0]}, momentum={saved[1]}, nesterov={saved[2]} "
                f"but this run has lr={self.lr}, momentum={self.momentum}, nesterov={self.nesterov}; "
                "build it with the saved options to resume"
            )
        anchors, velocities = list(state["anchors"]), list(state["velocities"])
        if not anchors:
            self.anchors = self.velocities = None
            return
        if len(anchors) != len(like) or len(velocities) != len(like) or \
                any(a.shape != p.shape or v.shape != p.shape for a, v, p in zip(anchors, velocities, like)):
            raise ValueError("the checkpoint's outer-optimizer anchors do not match the parameters' shapes: "
                             "it was saved from a different model")
        self.anchors = [a.to(device=p.device, dtype=p.dtype).clone() for a, p in zip(anchors, like)]
        self.velocities = [v.to(device=p.device, dtype=p.dtype).clone() for v, p in zip(velocities, like)]


def outer_settings(outer) -> Dict[str, object]:
    """The cross-rank checks' view of an outer optimizer (an :class:`OuterSGD`, or one with ``settings()``, as
    :class:`~ddp_hooks.adaalter.outer_optimizer.OuterOptimizer`); ``None`` reads as plain averaging."""
    if outer is None:
        return {"outer_lr": 1.0, "outer_momentum": 0.0, "outer_nesterov": True, "outer_kind": 0}
    if not isinstance(outer, OuterSGD):
        return outer.settings()
    return {"outer_lr": outer.lr, "outer_momentum": outer.momentum, "outer_nesterov": outer.nesterov,
            "outer_kind": 0}

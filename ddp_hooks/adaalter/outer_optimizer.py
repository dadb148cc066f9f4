r"""Any ``torch.optim`` optimizer as local SGD's outer optimizer, stepping on the round's pseudo-gradient.

As torchft's DiLoCo does, the user builds the outer optimizer over the
model's own parameters. At each synchronisation, with ``x_a`` the anchor
(the parameters every rank shared when the round began) and ``xbar`` the
new average, :meth:`OuterOptimizer.step_` puts the parameters back at
``x_a``, writes the averaged pseudo-gradient ``x_a - xbar`` into their
``.grad`` and calls the optimizer's ``step()``; the inner gradients are put
back afterwards. ``torch.optim.SGD(params, lr, momentum, nesterov=True)``
then computes what :class:`~ddp_hooks.adaalter.outer_sgd.OuterSGD` does.
Every rank computes the same numbers from the same averaged tensors.

Example::

    >>> import torch
    >>> x = torch.nn.Parameter(torch.tensor([4.0]))
    >>> outer = OuterOptimizer(torch.optim.SGD([x], lr=0.5))
    >>> outer.set_anchor([x])                    # synchronised parameters before a round
    >>> _ = x.data.fill_(2.0)                    # the round's average moved x by -2
    >>> outer.step_([x]); x.data                 # half of that step
    tensor([3.])
"""

from __future__ import annotations

import zlib
from typing import Dict, List, Optional, Sequence

import torch

from .anchors import check_anchors, restored_anchors

__all__ = ["OuterOptimizer"]


class OuterOptimizer:
    """Wrap a ``torch.optim`` optimizer built over the model's parameters as the outer optimizer.

    Args:
        optimizer (torch.optim.Optimizer): built over exactly the parameters
            that are averaged (e.g. ``torch.optim.SGD(model.parameters(),
            lr=0.7, momentum=0.9, nesterov=True)``, DiLoCo's).

    Its ``state_dict`` holds the optimizer's and the anchors.
    """

    is_plain_average = False  # (an optimizer's step is never assumed to be the identity)

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"`outer_optimizer` must be a torch.optim.Optimizer built over the model's parameters, "
                            f"got {type(optimizer).__name__}")
        self.optimizer = optimizer
        self.anchors: Optional[List[torch.Tensor]] = None

    @property
    def has_anchor(self) -> bool:
        return self.anchors is not None

    @torch.no_grad()
    def set_anchor(self, params: Sequence[torch.Tensor]) -> None:
        """Remember ``params`` (synchronised: the same on every rank) as the start of the next round."""
        self.check_params(params)
        self.anchors = [p.detach().clone() for p in params]

    def apply_(self, params: Sequence[torch.Tensor]) -> None:
        """At an averaging: the outer step from the anchor, or at the first (no anchor yet) only remember it."""
        if self.anchors is None:
            self.set_anchor(params)
        else:
            self.step_(params)

    def check_params(self, params: Sequence[torch.Tensor]) -> None:
        """``ValueError`` unless ``params`` are exactly the optimizer's parameters (in any order)."""
        mine = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        given = {id(p) for p in params}
        if mine != given:
            raise ValueError(f"the outer optimizer holds {len(mine)} parameters but {len(given)} are averaged, "
                             f"{len(mine & given)} of them its own: build it over exactly the averaged parameters "
                             "(the model's), so that each receives its pseudo-gradient")

    @torch.no_grad()
    def step_(self, params: Sequence[torch.Tensor]) -> None:
        """Replace the averaged ``params`` by the optimizer's step from the anchor; the result is the next anchor."""
        if self.anchors is None:
            raise RuntimeError("OuterOptimizer.step_() needs the round's starting point: call set_anchor() first")
        if len(params) != len(self.anchors):
            raise ValueError(f"OuterOptimizer got {len(params)} tensors but holds {len(self.anchors)} anchors")
        inner = [p.grad for p in params]
        for p, anchor in zip(params, self.anchors):
            p.grad = anchor - p            # the round's averaged pseudo-gradient
            p.copy_(anchor)
        self.optimizer.step()
        for p, anchor, grad in zip(params, self.anchors, inner):
            p.grad = grad
            anchor.copy_(p)

    def state_dict(self) -> Dict[str, object]:
        """The optimizer's class, settings and state dict, and the anchors (empty before the first)."""
        return {"kind": type(self.optimizer).__name__, "settings": self.settings(),
                "optimizer": self.optimizer.state_dict(), "anchors": list(self.anchors or [])}

    def check_loadable(self, state: Dict[str, object], like: Sequence[torch.Tensor]) -> None:
        """Raise ``ValueError`` unless ``state`` comes from an outer optimizer like this one over parameters
        shaped like ``like`` (``torch.optim`` would take another's hyperparameters, or fail at its step)."""
        if "optimizer" not in state:
            raise ValueError("the checkpoint's outer optimizer is the built-in OuterSGD (outer_lr, outer_momentum) "
                             "and this one a torch.optim optimizer; build it with the saved kind to resume")
        saved = (state.get("kind"), state.get("settings"))
        if saved != (type(self.optimizer).__name__, self.settings()):
            raise ValueError(f"the checkpoint's outer optimizer is {saved[0]} with {saved[1]} and this one "
                             f"{type(self.optimizer).__name__} with {self.settings()}; build it as it was saved "
                             "to resume")
        check_anchors(list(state["anchors"]), like, "outer-optimizer")

    def load_state_dict(self, state: Dict[str, object], like: Sequence[torch.Tensor]) -> None:
        """Restore a :meth:`state_dict`; ``like`` are the parameters (for shapes and devices)."""
        self.check_loadable(state, like)
        self.optimizer.load_state_dict(state["optimizer"])
        self.anchors = restored_anchors(list(state["anchors"]), like)

    def settings(self) -> Dict[str, object]:
        """The cross-rank checks' view: its class and group 0's numbers in OuterSGD's keys, and a checksum."""
        first = self.optimizer.param_groups[0]
        numbers = [[(k, v) for k, v in sorted(g.items()) if isinstance(v, (bool, int, float))]
                   for g in self.optimizer.param_groups]
        return {"outer_lr": float(first.get("lr", 0.0)), "outer_momentum": float(first.get("momentum", 0.0)),
                "outer_nesterov": bool(first.get("nesterov", False)),
                "outer_kind": zlib.crc32(repr((type(self.optimizer).__name__, numbers)).encode()) or 1}

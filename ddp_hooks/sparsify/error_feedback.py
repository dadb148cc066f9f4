r"""Error feedback and momentum in sends: the per-rank states, and the one place they absorb a gradient.

The error-feedback recursion (Eghlidi & Jaggi 2020, arXiv 2009.09271;
residual ``e`` starts at 0 and is kept per rank in float32):

.. math:: p_t = g_t + e_t,\quad c_t = C_k(p_t),\quad e_{t+1} = p_t - c_t,
          \quad \hat g_t = \tfrac{1}{W}\textstyle\sum_{r} c_t^{(r)}

With a velocity (``SparsifyState(momentum=m)``, or the optimizer's
momentum counted in sends) (``g_t`` includes ``wd * x_t``), each rank also
keeps a velocity ``w`` (starts at 0) that moves only at the positions
``S_t`` it sends, and what it sends there is the stepped velocity:

.. math:: p_t = g_t + e_t,\quad
          w_{t+1}[S_t] = m\,w_t[S_t] + p_t[S_t],\quad
          c_t = w_{t+1}[S_t] \text{ on } S_t,\quad
          e_{t+1} = p_t \text{ off } S_t,\ 0 \text{ on } S_t

and ``w`` keeps its value off ``S_t``. So every gradient reaches the model
exactly once, plus momentum's carry at each send:
:math:`\sum_{s\le t} c_s + e_{t+1} = \sum_{s\le t} g_s +
m \sum_{s\le t} w_s[S_s]` (per rank; the model gets the mean over
ranks). At density 1 every position is sent at every step and this is
momentum SGD (torch.optim.SGD with ``momentum=m, weight_decay=wd``).
Below it momentum counts *sends*, not steps: a coordinate that waited
``D`` steps leaves with its ``D`` gradients plus ``m`` times its velocity
from its last send. Why not the optimizer's momentum, or a velocity
stepped every step (DGC's form): with a random selector a coordinate
leaves about once every ``1 / density`` steps carrying that many
gradients, and a velocity that steps every step multiplies that stale
burst by ``1 / (1 - m)``; at lr 0.1, m 0.9 the burst is 20 times a dense
step at density 0.05 and 100 at 0.01, and training diverges, as it does
without momentum at lr 1.0 (``bench/bench_convergence.py``). In send
time the stale burst is a heavy-ball step on ``D`` gradients, stable up to
``lr * D * curvature < 2 (1 + m)``, while a steady gradient still gains
the full ``1 / (1 - m)`` over successive sends.


Here: :func:`compensated` forms ``p`` (or ``p`` at the sent positions only),
and :func:`fold_step` applies one step to this rank's residual and velocity
once the step's verdict is known; a launched exchange records what it needs
in a :class:`ResidualChange` and a :class:`VelocityChange`.

Example (one step at density 1/2 on one rank: what is not sent stays)::

    >>> import torch
    >>> e, g = torch.zeros(4), torch.tensor([3.0, -1.0, 0.5, 2.0])
    >>> sent_at = torch.tensor([0, 3])
    >>> change = ResidualChange(vector=e, before=e.index_select(0, sent_at), rounding=None)
    >>> fold_step(g, sent_at, change, None, discard=torch.tensor(False), inv_scale=None)
    >>> e.tolist()
    [0.0, -1.0, 0.5, 0.0]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .nonfinite import fill_if
from .positions import put, zero_at

__all__ = ["compensated", "carried", "ResidualChange", "VelocityChange", "fold_step"]


def compensated(grad: torch.Tensor, carry: Optional[torch.Tensor], scale: Optional[torch.Tensor],
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``p = g + S c`` in float32, ``c`` what the rank carries (residual, plus weight decay); ``S`` = 1 without a scaler."""
    if carry is None:
        return grad.float() if out is None else out.copy_(grad)
    if scale is None:
        return torch.add(carry, grad, out=out)
    return torch.addcmul(grad.float(), carry, scale, out=out)


def carried(residual: Optional[torch.Tensor], decay: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``e + d``: the residual plus the weight-decay term, either of which may be absent."""
    if decay is None:
        return residual
    return decay if residual is None else residual + decay


@dataclass
class ResidualChange:
    """What a step does to a rank's residual ``e``, laid out like the gradient, at the positions it sent."""

    vector: torch.Tensor  # e itself (float32)
    before: torch.Tensor  # e at the sent positions before the step
    rounding: Optional[torch.Tensor]  # what stays in e there: the wire dtype's rounding (scaled); None: 0
    cancelled: bool = False  # the gradient at the sent positions already holds -before: e + g is 0 there
    decay: Optional[torch.Tensor] = None  # float32 weight_decay * x laid out like e, or None


@dataclass
class VelocityChange:
    """What a step does to a rank's velocity ``w`` at the positions it sent: ``w = sent / S`` there."""

    vector: torch.Tensor  # w itself (float32)
    before: torch.Tensor  # w at the sent positions before the step
    sent: torch.Tensor  # the float32 values sent there (scaled units)


def fold_step(grad: torch.Tensor, positions: torch.Tensor, residual: ResidualChange,
              velocity: Optional[VelocityChange], *, discard: torch.Tensor, inv_scale: Optional[torch.Tensor],
              idle: Optional[torch.Tensor] = None, beta: float = 1.0, whole: bool = False) -> None:
    """Fold the step's gradient into this rank's float32 states; a discarded step leaves them unchanged.

    The one place where the per-rank states absorb a gradient, and so where
    non-finite steps and the loss scale are handled for all of them: the
    gradient ``grad`` (and the weight-decay term) is zeroed when the step is
    discarded (``discard``, a 0-dim bool), and consumed times ``1/S``. Then
    ``e = e + g / S + d`` everywhere and, at the sent ``positions``, what was
    not sent (0, or the rounding to the wire dtype), and with a velocity
    ``w = sent / S`` there. Positions whose parameter had no gradient
    (``idle``, one bool per sent position) and discarded steps keep ``e``
    and ``w``. ``grad`` may be overwritten (it receives the result next).

    With ``beta`` < 1 (ScaleCom's low-pass filter, ``error_feedback_beta``)
    the residual becomes ``(1 - beta) e + beta (p - c)``: ``e + beta g / S``
    where nothing was sent, ``(1 - beta) e + beta r`` where it was (``r``
    the rounding to the wire dtype, else 0).

    ``whole``: ``positions`` are every position in order (:mod:`.positions`);
    every entry of ``e`` is then written at the sent positions, so ``e`` is
    not first added to.
    """
    e = residual.vector
    on_host = discard.device.type == "cpu"  # the verdict is free to read there: branch instead of masking
    if on_host and bool(discard):
        return
    if not on_host:
        fill_if(grad, discard, 0.0, sync_free=True)
        if residual.decay is not None:
            fill_if(residual.decay, discard, 0.0, sync_free=True)
    if not whole:  # (sent whole, e is overwritten at every position below)
        if inv_scale is not None and beta == 1.0:
            e.addcmul_(grad, inv_scale)
        else:
            e.add_(grad if inv_scale is None else grad * inv_scale, alpha=beta)
        if residual.decay is not None:
            e.add_(residual.decay, alpha=beta)
    # positions whose states keep their values (a parameter without a gradient; on a device, a discarded step);
    # they had no gradient added (an idle parameter's is 0, a discarded step's was zeroed): e before
    frozen = idle if on_host else (discard if idle is None else idle | discard)
    remainder = residual.rounding
    if remainder is not None and inv_scale is not None:
        remainder = remainder * inv_scale
    if beta != 1.0:  # (1 - beta) e_before + beta r at the sent positions
        left = residual.before * (1.0 - beta)
        if remainder is not None:
            left.add_(remainder, alpha=beta)
        put(e, positions, left if frozen is None else torch.where(frozen, residual.before, left), whole)
    elif frozen is None:
        if remainder is None:
            if not residual.cancelled:  # (cancelled: e + grad is 0 at `positions` already)
                zero_at(e, positions, whole)
        else:
            put(e, positions, remainder, whole)
    else:
        if remainder is None:
            remainder = torch.zeros((), dtype=e.dtype, device=e.device)
        put(e, positions, torch.where(frozen, residual.before, remainder), whole)
    if velocity is not None:
        sent = velocity.sent if inv_scale is None else velocity.sent * inv_scale
        put(velocity.vector, positions, sent if frozen is None else torch.where(frozen, velocity.before, sent), whole)

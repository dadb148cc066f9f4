"""The end of a step of :func:`~ddp_hooks.sparsify_hook`: one verdict, then the states and the results.

Once every exchange of the step has finished, :func:`commit` decides whether
the step is discarded (any rank sent a non-finite value: the same verdict on
every rank, since all saw the same data), folds the gradient into this
rank's states (:func:`~.error_feedback.fold_step`), and writes each
exchange's average into the bucket, or into the zero-kept result vector of
:mod:`.sparse_output` where the hook returns that. With the optimizer's
momentum counted in sends, the result becomes ``u_t - m u_{t-1}``
(:func:`~.last_update.present_update`).
"""

from __future__ import annotations

from typing import List, Optional

import torch

from .error_feedback import fold_step
from .exchange import Flight
from .last_update import present_update

__all__ = ["commit"]


def commit(state, flights: List[Flight], scale: Optional[torch.Tensor]) -> None:
    """Apply the finished ``flights`` of one step of ``state`` (a :class:`~ddp_hooks.SparsifyState`)."""
    results = [flight.future.value() for flight in flights]
    discard = torch.stack([bad for bad, _ in results]).any()  # the same on every rank: all saw the same data
    state.nonfinite.add(discard)
    inv_scale = None if scale is None else scale.reciprocal()
    # The last update is remembered only from steps the optimizer takes (a host read off the CPU).
    applied = None if not any(f.update is not None for f in flights) else not bool(discard)
    for flight, (_, write) in zip(flights, results):
        if flight.residual is not None:
            fold_step(flight.grad, flight.positions, flight.residual, flight.velocity, discard=discard,
                      inv_scale=inv_scale, idle=flight.idle, beta=state.options.error_feedback_beta,
                      whole=flight.whole)
        if flight.whole:  # the write covers every position: nothing to zero first
            target = flight.grad if flight.result is None else flight.result.overwrite()
        else:
            target = flight.grad.zero_() if flight.result is None else flight.result.clear()
        written = write(target)
        if flight.update is not None and applied:
            written = present_update(state.last_updates, flight.update, target, written, scale, inv_scale,
                                     whole=flight.whole)
        if flight.result is not None:
            flight.result.written = written
        if flight.outputs is not None:
            for buffer, chunk in zip(flight.outputs, flight.grad.split([b.numel() for b in flight.outputs])):
                buffer.copy_(chunk)

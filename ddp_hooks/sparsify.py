r"""The sparsifying DDP communication hook: top-k, random-k and random-block-k with error feedback.

Per rank, per step, for each unit of selection (a layer, the bucket, or all
buckets: :class:`~ddp_hooks.SparsifyState`'s ``scope``), following Eghlidi &
Jaggi, "Sparse Communication for Training Deep Networks" (2020,
arXiv 2009.09271):

1. Compensate: ``p = g + e`` with the float32 residual ``e`` of the bucket
   (one pass over the gradient, the floor of any error-feedback method);
   with ``weight_decay`` the gradient term is ``g + wd * x``.
2. Select ``k = ceil(density * n)`` positions of ``p`` per unit
   (:mod:`ddp_hooks.selection`). With ``momentum`` m, the rank's velocity
   steps at those positions only, ``w = m w + p``, and ``w`` is sent there
   (momentum in sends, not steps: :class:`~ddp_hooks.SparsifyState`).
3. Keep the rest: ``e = p - c``, i.e. the selected positions of the residual
   are cleared (or keep the rounding error when the wire dtype is half).
4. Exchange: AllReduce of the values when every rank chose the same positions;
   AllGather of values (plus int32 positions for top-k) otherwise.
5. Write the average over ranks into ``bucket.buffer()`` in place (zeros
   elsewhere), as PyTorch's own hooks do; on the CPU, for float32 buckets
   that are not the gradients' storage, into a vector kept at zero between
   steps instead, so only O(k) entries are cleared and written
   (:mod:`ddp_hooks.sparse_output`).

Steps 1 and 3 happen at the end of the step, when every bucket's exchange
has finished (DDP waits for all buckets' futures only at the end of backward
anyway): each bucket's exchange starts as soon as DDP hands the bucket over,
but its residual is updated and its result written only once the whole step
is known to be finite. Until then the bucket buffer still holds ``g``, so no
copy of the residual is needed to undo anything. The step counter advances on
the last bucket of each backward.

Non-finite gradients (an AMP overflow, a NaN): while compensating, each
bucket's per-parameter minimum and maximum are taken (one read pass of the
gradient, no host sync; NaN and inf propagate into them). A rank whose bucket
holds inf or NaN sends NaN in place of its values, so every rank receives it,
whichever positions it was at. At the end of the step, if any exchange of the
step carried a non-finite value, the step is discarded on every rank alike:
the outputs hold NaN (``GradScaler`` skips the step on every rank), and the
gradient is zeroed before it is folded into the residuals
(:func:`_update_states`, the one place where per-rank states absorb a
gradient), which therefore keep exactly their values from before the step;
no inf or NaN can enter them. On CPU the verdict is read on the host; on
other devices a broadcast ``masked_fill_`` keeps the hook free of host syncs.

Warm-up: plain allreduce for the first ``warmup_steps`` steps; with momentum
or weight decay in the hook the optimizer has neither, so warm-up steps send
every position through the same path (the velocity steps everywhere). Then
the density falls from 1 to ``density`` over ``density_warmup_steps``
(:meth:`SparsifyState.density_at`; by default over 1000 steps).

The optimizer's momentum (``optimizer_momentum="sends"``, the default with
error feedback): the velocity of step 2 runs with each parameter's momentum
``m`` read from its ``torch.optim.SGD``, and the result written in step 5 is
``u_t - m u_{t-1}``, where ``u_t`` is the average over ranks of the sent
velocities and ``u_{t-1}`` the last step's, kept sparse
(:mod:`ddp_hooks.last_update`). SGD's buffer ``m buf + grad`` then holds
``u_t`` (plus the momentum of its dense weight decay): its step is
``lr u_t``, momentum counted in sends, in the user's unchanged code.

Parameters without a gradient: DDP with ``find_unused_parameters=True`` (or
``static_graph=True``) fills the slot of an unused parameter with zeros and,
when no rank used it, does not copy the bucket's result into its ``.grad``.
A rank therefore sends nothing (zeros) for a parameter whose gradient is all
zero at this step (min = max = 0) and keeps that parameter's residual for a
later step; otherwise the residual sent for it would be lost.

The loss scale: with ``SparsifyState(grad_scaler=scaler)`` the residuals and
velocities are kept unscaled: ``p = g + S e`` (``S`` read from the scaler at
the first bucket, as a tensor), ``e <- e + g / S`` and ``w <- sent / S``. Powers of two (GradScaler's
defaults) make this exact, so training with the scaler follows training
without it.

Example (one process, so the average is the rank's own sparse gradient)::

    >>> import os, tempfile, torch, torch.distributed as dist
    >>> from torch.nn.parallel import DistributedDataParallel as DDP
    >>> from ddp_hooks import SparsifyState, sparsify_hook
    >>> store = os.path.join(tempfile.mkdtemp(), "store")
    >>> dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    >>> model = DDP(torch.nn.Linear(100, 10))
    >>> state = SparsifyState(method="random_block", density=0.1, density_warmup_steps=0)  # sparse at once
    >>> model.register_comm_hook(state, sparsify_hook)
    >>> model(torch.randn(8, 100)).sum().backward()
    >>> int((model.module.weight.grad != 0).sum())   # ceil(0.1 * 1000)
    100
    >>> state.stats()["steps"]
    1
    >>> dist.destroy_process_group()
"""

from typing import List

import torch
import torch.distributed as dist

from ._internal.validation import check_hook_call
from ._internal.collectives import allreduce_mean
from .selection import Unit
from .last_update import UpdateRecord
from .sparsify_exchange import _commit, _decay, _launch, _launch_global, _scan
from .sparsify_state import SparsifyState

__all__ = ["sparsify_hook"]

def _wait_for_last(state: SparsifyState, buffer: torch.Tensor) -> torch.futures.Future:
    """The future of a bucket that is not the last: ``buffer`` once the step is committed, or the step's error."""
    def after_commit(step_done):
        step_done.value()  # raises the step's error, so DDP sees a failed future, not a value
        return buffer

    return state._step_done.then(after_commit)


def _finish_step(state: SparsifyState, last_buffer: torch.Tensor) -> torch.futures.Future:
    """At the last bucket: once every exchange of the step has finished, commit and complete all futures."""
    flights, step_done, scale = state._flights, state._step_done, state._scale
    state._flights = []

    def commit(all_done):
        try:
            all_done.value()  # the first failed exchange's error; collect_all may end before the others finish
            _commit(state, flights, scale)
        except Exception as exc:  # a failed collective (a rank died, a timeout) fails every bucket's future
            step_done.set_exception(exc)
            raise
        step_done.set_result(None)
        return last_buffer

    return torch.futures.collect_all([flight.future for flight in flights]).then(commit)


# No `from __future__ import annotations` in this module: DDP's register_comm_hook
# compares the hook's annotations with dist.GradBucket and Future[Tensor] objects.
def sparsify_hook(state: SparsifyState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Sparsify a DDP gradient bucket with error feedback and average it across ranks.

    Register with ``ddp_model.register_comm_hook(state, sparsify_hook)``; see
    the module docstring for the algorithm and :class:`SparsifyState` for the
    options.

    Args:
        state (SparsifyState): options, residuals and counters.
        bucket (dist.GradBucket): the bucket DDP hands to the hook.

    Returns:
        A future holding the average over ranks of each rank's sparsified
        compensated gradient: written into ``bucket.buffer()``, or, for
        float32 buckets on the CPU without ``gradient_as_bucket_view``, into
        a vector of the state kept at zero between steps
        (:mod:`ddp_hooks.sparse_output`), which DDP copies into ``.grad``
        alike. It completes when the step's last bucket has been exchanged.
    """
    check_hook_call("sparsify_hook", state, SparsifyState, bucket)
    state._bind(bucket)
    index, buffer, last = bucket.index(), bucket.buffer(), bucket.is_last()
    if index == 0:  # DDP hands buckets over in index order
        state._begin_step(buffer.device)
    # Parameter keys are assigned at the very first call, warm-up included, so
    # that a resumed run (which starts on DDP's initial buckets) numbers the
    # parameters exactly as the uninterrupted run did.
    layout, starts = state._layout(bucket)
    dense = state.step < state.warmup_steps
    if dense and state.momentum == 0.0 and state.weight_decay == 0.0:
        n = buffer.numel()
        state._stats.add(n, n * buffer.element_size(), n, n * buffer.element_size())
        fut = allreduce_mean(buffer, state._group, state._world_size)
        if last:
            state._end_step(index, compressed=False)
        return fut
    gradients = bucket.gradients()  # views of the buffer, one per parameter
    marks = _scan(buffer, gradients, starts)
    result = buffer
    decay = _decay(state, bucket.parameters(), layout, buffer.numel(), buffer.device)
    density = state.density_at(state.step)
    if state.scope == "global" and not dense:
        state._waiting.append((buffer, layout, starts, marks, decay))
        if not last:
            return _wait_for_last(state, buffer)
        state._flights.append(_launch_global(state, state.step, density))
    else:
        residual = velocity = None
        if state.error_feedback:
            residual = state.residuals.bucket_residual(index, layout, buffer.numel(), buffer.device)
        momentum = state.send_momentum(layout, buffer.device)
        if momentum is not None:
            velocity = state.velocities.bucket_residual(index, layout, buffer.numel(), buffer.device)
        if state.scope == "layer":
            units: List[Unit] = [Unit(key, offset, n) for key, offset, n in layout if n]  # an empty one has no budget
        else:
            units = [Unit(index, 0, buffer.numel())]
        flight = _launch(state, buffer, residual, units, starts, marks, state.step, decay, velocity, everything=dense,
                         density=density, momentum=0.0 if momentum is None else momentum)
        if state.counts_momentum_in_sends and not dense:
            flight.update = UpdateRecord(index, layout, starts, 0.0 if momentum is None else momentum)
        if not dense:  # where it pays, the result goes to a vector kept at zero between steps
            flight.result = state._results.for_bucket(index, buffer, gradients, bucket.parameters())
        state._flights.append(flight)
        result = buffer if flight.result is None else flight.result.tensor
        if not last:
            return _wait_for_last(state, result)
    fut = _finish_step(state, result)
    state._end_step(index, compressed=not dense)
    return fut

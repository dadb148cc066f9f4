r"""The sparsifying DDP communication hook: top-k, random-k and random-block-k with error feedback.

Per rank, per step, for each unit of selection (a layer, the bucket, or all
buckets: :class:`~ddp_hooks.SparsifyState`'s ``scope``), following Eghlidi &
Jaggi, "Sparse Communication for Training Deep Networks" (2020,
arXiv 2009.09271):

1. Compensate: ``p = g + e`` with the float32 residual ``e`` of the bucket
   (one pass over the gradient, the floor of any error-feedback method);
   with ``weight_decay`` the gradient term is ``g + wd * x``.
2. Select ``k = ceil(density * n)`` positions of ``p`` per unit
   (:mod:`ddp_hooks.sparsify.selectors`). With ``momentum`` m, the rank's velocity
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
   (:mod:`ddp_hooks.sparsify.sparse_output`).

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
(:func:`~ddp_hooks.sparsify.error_feedback.fold_step`, the one place where per-rank states absorb a
gradient), which therefore keep exactly their values from before the step;
no inf or NaN can enter them. On CPU the verdict is read on the host; on
other devices a broadcast ``masked_fill_`` keeps the hook free of host syncs.

Warm-up: plain allreduce for the first ``warmup_steps`` steps; with momentum
or weight decay in the hook the optimizer has neither, so warm-up steps send
every position through the same path (the velocity steps everywhere). Then
the density falls from 1 to ``density`` over ``density_warmup_steps``
(:meth:`SparsifyState.density_at`; by default over 1000 steps). Under
AllGather, a step whose gather would move more bytes than an AllReduce of
every entry (top-k at 4 ranks: density 1/4 and above) sends every entry of
``p`` by AllReduce instead
(:func:`~ddp_hooks.sparsify.exchange.gather_outweighs_allreduce`).

The optimizer's momentum (``optimizer_momentum="sends"``, the default with
error feedback): the velocity of step 2 runs with each parameter's momentum
``m`` read from its ``torch.optim.SGD``, and the result written in step 5 is
``u_t - m u_{t-1}``, where ``u_t`` is the average over ranks of the sent
velocities and ``u_{t-1}`` the last step's, kept sparse
(:mod:`ddp_hooks.sparsify.last_update`). SGD's buffer ``m buf + grad`` then holds
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

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .._internal.collectives import allreduce_mean
from .._internal.validation import check_hook_call
from .commit import commit
from .exchange import Piece, send, start
from .last_update import UpdateRecord
from .layout import GLOBAL_BUCKET, Layout
from .nonfinite import scan
from .selectors import Unit
from .state import SparsifyState
from .step_run import StartedBucket, StepRun, WaitingBucket

__all__ = ["sparsify_hook"]


def _wait_for_last(run: StepRun, buffer: torch.Tensor) -> torch.futures.Future:
    """The future of a bucket that is not the last: ``buffer`` once the step is committed, or the step's error."""
    def after_commit(step_done):
        step_done.value()  # raises the step's error, so DDP sees a failed future, not a value
        return buffer

    return run.done.then(after_commit)


def _finish_step(state: SparsifyState, last_buffer: torch.Tensor) -> torch.futures.Future:
    """At the last bucket: once every exchange of the step has finished, commit and complete all futures."""
    run = state.run
    flights, step_done = run.take_flights()

    def commit_step(all_done):
        try:
            all_done.value()  # the first failed exchange's error; collect_all may end before the others finish
            commit(state, flights, run.scale)
        except Exception as exc:  # a failed collective (a rank died, a timeout) fails every bucket's future
            step_done.set_exception(exc)
            raise
        step_done.set_result(None)
        return last_buffer

    return torch.futures.collect_all([flight.future for flight in flights]).then(commit_step)


def _decay(state: SparsifyState, params: Sequence[torch.Tensor], layout: Layout, numel: int,
           device: torch.device) -> Optional[torch.Tensor]:
    """``weight_decay * x`` laid out like the bucket, in float32, or None without weight decay in the hook."""
    weight_decay = state.options.weight_decay
    if weight_decay == 0.0:
        return None
    decay = torch.empty(numel, dtype=torch.float32, device=device)
    for param, (_, offset, n) in zip(params, layout):
        torch.mul(param.detach().reshape(-1), weight_decay, out=decay[offset:offset + n])
    return decay


def _start(state: SparsifyState, *, index: int, grad: torch.Tensor, layout: Layout, units, starts, marks,
           decay, dense: bool, density: float) -> StartedBucket:
    """Start the exchange of bucket ``index`` (or GLOBAL_BUCKET) with this rank's states for it: its selection."""
    residual = velocity = None
    if state.options.error_feedback:
        residual = state.residuals.bucket_residual(index, layout, grad.numel(), grad.device)
    momentum = state.send_momentum(layout, grad.device)
    if momentum is not None:
        velocity = state.velocities.bucket_residual(index, layout, grad.numel(), grad.device)
    piece = Piece(grad=grad, units=tuple(units), starts=starts, marks=marks, residual=residual, velocity=velocity,
                  decay=decay, momentum=0.0 if momentum is None else momentum)
    update = None
    if state.counts_momentum_in_sends and not dense:
        update = UpdateRecord(index, layout, starts, piece.momentum)
    return StartedBucket(start(state, piece, step=state.step, density=density, everything=dense), update)


def _send(state: SparsifyState, started: StartedBucket) -> None:
    """Finish a started bucket's exchange (its positions awaited, its values' collective launched): a flight."""
    flight = send(state, started.exchange)
    flight.update, flight.result, flight.outputs = started.update, started.result, started.outputs
    state.run.flights.append(flight)


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
        (:mod:`ddp_hooks.sparsify.sparse_output`), which DDP copies into
        ``.grad`` alike. It completes when the step's last bucket has been
        exchanged.
    """
    check_hook_call("sparsify_hook", state, SparsifyState, bucket)
    state.bind(bucket)
    index, buffer, last = bucket.index(), bucket.buffer(), bucket.is_last()
    run = state.begin_step(buffer.device) if index == 0 else state.run  # DDP hands buckets over in index order
    # Parameter keys are assigned at the very first call, warm-up included, so
    # that a resumed run (which starts on DDP's initial buckets) numbers the
    # parameters exactly as the uninterrupted run did.
    layout, starts = state.layouts.of_ddp_bucket(bucket)
    options = state.options
    dense = state.step < options.warmup_steps
    if dense and options.momentum == 0.0 and options.weight_decay == 0.0:
        n = buffer.numel()
        state.counters.add(n, n * buffer.element_size(), n, n * buffer.element_size())
        fut = allreduce_mean(buffer, state.binding.group, state.binding.world_size)
        if last:
            state.end_step(index, compressed=False)
        return fut
    gradients = bucket.gradients()  # views of the buffer, one per parameter
    marks = scan(buffer, gradients, starts)
    result = buffer
    decay = _decay(state, bucket.parameters(), layout, buffer.numel(), buffer.device)
    density = options.density_at(state.step)
    if options.scope == "global" and not dense:
        run.waiting.append(WaitingBucket(buffer, layout, starts, marks, decay))
        if not last:
            return _wait_for_last(run, buffer)
        joined = run.join_waiting(with_decay=options.weight_decay != 0.0)
        started = _start(state, index=GLOBAL_BUCKET, grad=joined.grad, layout=joined.layout,
                         units=[Unit(0, 0, joined.grad.numel())], starts=joined.starts, marks=joined.marks,
                         decay=joined.decay, dense=False, density=density)
        started.outputs = joined.buffers
        run.started.append(started)
    else:
        if options.scope == "layer":
            units = [Unit(key, offset, n) for key, offset, n in layout if n]  # an empty one has no budget
        else:
            units = [Unit(index, 0, buffer.numel())]
        started = _start(state, index=index, grad=buffer, layout=layout, units=units, starts=starts, marks=marks,
                         decay=decay, dense=dense, density=density)
        if not dense:  # where it pays, the result goes to a vector kept at zero between steps
            started.result = state.results.for_bucket(index, buffer, gradients, bucket.parameters())
        run.started.append(started)
        result = buffer if started.result is None else started.result.tensor
    # Send what has started, in bucket order on every rank; a selection still waiting for its selector's
    # collectives waits until the next bucket has started its own (or until the last bucket).
    for earlier in run.take_started(keep_last=not last and started.exchange.choice.waits):
        _send(state, earlier)
    if not last:
        return _wait_for_last(run, result)
    fut = _finish_step(state, result)
    state.end_step(index, compressed=not dense)
    return fut

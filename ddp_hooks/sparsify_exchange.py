"""The exchange machinery of :func:`~ddp_hooks.sparsify_hook`: launch one bucket's exchange, commit a step.

The algorithm, and the rules for non-finite steps, idle parameters, the loss
scale, momentum and weight decay, are described in :mod:`ddp_hooks.sparsify`.
Here: :func:`_launch` selects, packs and starts the collective of one bucket
(or, with ``scope="global"``, :func:`_launch_global` of all buckets joined)
and leaves every per-rank state untouched; :func:`_commit`, once all
exchanges of the step have finished, takes one verdict for the step, folds
the gradient into the states (:func:`_update_states`) and writes the averages
into the buckets, or into the zero-kept result vectors of
:mod:`ddp_hooks.sparse_output` where the hook returns those. Pure tensor work at world size 1, which is what
``bench/bench_sparsify_kernels.py`` times.
"""

from typing import Callable, List, Optional, Sequence, Tuple

import torch

from ._internal.collectives import allgather, allreduce_sum
from .last_update import UpdateRecord, present_update
from .residuals import GLOBAL_BUCKET
from ._internal.seeding import SHARED
from .selection import Unit, select, select_topk
from .sparse_output import zero_at
from .sparsify_state import SparsifyState

# What an exchange yields once it has finished: whether any rank sent a
# non-finite value, and how to write the average into an all-zero target
# vector (the write returns the positions it touched).
Result = Tuple[torch.Tensor, Callable[[torch.Tensor], List[torch.Tensor]]]


class _Flight:
    """One exchange in flight, and what the end of the step needs to apply it."""

    __slots__ = ("grad", "residual", "positions", "before", "kept", "hold", "future", "outputs", "decay",
                 "velocity", "velocity_before", "sent", "result", "cancelled", "update")

    def __init__(self, grad, residual, positions, before, kept, hold, future, outputs=None):
        self.grad = grad  # the gradient (the bucket buffer, or the joined buckets); receives the result
        self.residual = residual  # float32 residual laid out like grad, or None without error feedback
        self.positions = positions  # this rank's sent positions
        self.before = before  # the residual at `positions` before the step
        self.kept = kept  # what stays in the residual at `positions` (scaled units; None: 0)
        self.hold = hold  # positions of parameters without a gradient this step (nothing sent, residual kept)
        self.future = future  # -> Result
        self.outputs = outputs  # global scope: the bucket buffers that receive `grad`'s chunks
        self.decay = None  # float32 weight_decay * x laid out like grad, or None
        self.velocity = None  # float32 velocity laid out like grad (momentum in the hook), or None
        self.velocity_before = None  # the velocity at `positions` before the step
        self.sent = None  # the float32 values this rank sent at `positions` (scaled units), for the velocity
        self.result = None  # a SparseOutput that receives the result instead of `grad`, or None
        self.cancelled = False  # grad at `positions` holds -before: e + grad is exactly 0 there
        self.update = None  # optimizer momentum counted in sends: an UpdateRecord, or None


def _fill_if(tensor: torch.Tensor, flag: torch.Tensor, value: float, sync_free: Optional[bool] = None) -> None:
    """``tensor.fill_(value)`` if the 0-dim bool ``flag`` is set.

    On CPU the flag is read on the host (free there); on other devices a
    broadcast ``masked_fill_`` avoids a host sync, which would stall the
    backward pipeline.
    """
    if sync_free is None:
        sync_free = flag.device.type != "cpu"
    if sync_free:
        tensor.masked_fill_(flag, value)
    elif flag:
        tensor.fill_(value)


def _scan(buffer: torch.Tensor, gradients: Sequence[torch.Tensor], starts: torch.Tensor) -> torch.Tensor:
    """Per parameter, a float32 mark of its gradient: 0 if all zero, NaN if it holds inf/NaN, else 1.

    A zero mark is a parameter without a gradient at this step (DDP
    zero-fills unused parameters): its residual is held. A NaN mark is a
    non-finite gradient, which must reach every rank (see
    :mod:`ddp_hooks.sparsify`). ``buffer`` is the flat bucket, ``gradients``
    its per-parameter views, ``starts`` their offsets (on the buffer's device).

    On the CPU, for float32 and float64, one read pass over the bucket:
    ``sum(buffer)`` is finite iff every entry is (an inf or NaN propagates
    into the sum; a sum that overflows is measured again per parameter), and
    a parameter whose first entry is non-zero has a gradient; only the rare
    parameter whose first entry is zero is read whole. The sum reads one
    vector, where the ``residual.add_(grad)`` that error feedback needs
    anyway reads two and writes one. Elsewhere, and for half precision, a
    parameter's mark comes from its ``max |g|`` (``aminmax``), with no host
    sync.
    """
    if not gradients:
        return torch.zeros(0)
    if buffer.device.type != "cpu" or buffer.dtype not in (torch.float32, torch.float64) or not buffer.numel():
        return _marks(torch.stack([_max_magnitude(g) for g in gradients]))
    if not torch.isfinite(buffer.sum()):  # an inf or NaN somewhere, or a sum that overflowed
        return _marks(torch.stack([_max_magnitude(g) for g in gradients]))
    firsts = buffer.index_select(0, starts.clamp(max=buffer.numel() - 1))
    marks = (firsts != 0).float()
    for i, g in enumerate(gradients):
        if not g.numel():  # its start is the next parameter's (or past the end)
            marks[i] = 0.0
    for i in torch.nonzero(marks == 0).squeeze(1).tolist():  # usually only empty ones: read the others whole
        marks[i] = float(bool(gradients[i].any()))
    return marks


def _marks(magnitudes: torch.Tensor) -> torch.Tensor:
    """Per-parameter ``max |g|`` (any dtype) as marks: 0 stays 0, inf/NaN becomes NaN, anything else 1."""
    return (magnitudes != 0).float().masked_fill_(~torch.isfinite(magnitudes), float("nan"))


def _max_magnitude(g: torch.Tensor) -> torch.Tensor:
    if not g.numel():
        return g.new_zeros(())
    low, high = torch.aminmax(g)
    return torch.maximum(low.abs(), high.abs())


def _compensated(grad: torch.Tensor, carried: Optional[torch.Tensor], scale: Optional[torch.Tensor],
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``p = g + S c`` in float32, ``c`` what the rank carries (residual, plus weight decay); ``S`` = 1 without a scaler."""
    if carried is None:
        return grad.float() if out is None else out.copy_(grad)
    if scale is None:
        return torch.add(carried, grad, out=out)
    return torch.addcmul(grad.float(), carried, scale, out=out)


def _carried(residual: Optional[torch.Tensor], decay: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``e + d``: the residual plus the weight-decay term, either of which may be absent."""
    if decay is None:
        return residual
    return decay if residual is None else residual + decay


def _decay(state: SparsifyState, params: Sequence[torch.Tensor], layout, numel: int, device) -> Optional[torch.Tensor]:
    """``weight_decay * x`` laid out like the bucket, in float32, or None without weight decay in the hook."""
    if state.weight_decay == 0.0:
        return None
    decay = torch.empty(numel, dtype=torch.float32, device=device)
    for param, (_, offset, n) in zip(params, layout):
        torch.mul(param.detach().reshape(-1), state.weight_decay, out=decay[offset:offset + n])
    return decay


def _holds_nonfinite(received: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool tensor: ``received`` holds an inf or NaN.

    On the CPU one float32 sum decides when it is finite (an inf or NaN
    propagates into it); only a sum that is not finite, which an overflow
    can also cause, is followed by the elementwise check. Elsewhere the
    elementwise check, which needs no host sync.
    """
    if received.device.type == "cpu" and bool(torch.isfinite(received.sum(dtype=torch.float32))):
        return torch.zeros((), dtype=torch.bool)
    return ~torch.isfinite(received).all()


def _shared_result(positions: torch.Tensor, received: torch.Tensor) -> Result:
    def write(target):
        target.scatter_(0, positions, received)  # positions are distinct: a plain copy, faster than index_copy_
        return [positions]

    return _holds_nonfinite(received), write


def _gathered_result(state: SparsifyState, units, step: int, density: float, positions: torch.Tensor,
                     value_dtype: torch.dtype, index_dtype: torch.dtype, rows: torch.Tensor) -> Result:
    world, rank = state._world_size, state._rank
    if state.method == "topk":
        value_bytes = positions.numel() * value_dtype.itemsize
        values = rows[:, :value_bytes].view(value_dtype)
        # clone(): a row's index bytes need not start at a multiple of the index size
        parts = [(rows[r, value_bytes:].clone().view(index_dtype).long(), values[r]) for r in range(world)]
    else:  # each rank's positions are recomputed from (seed, step, unit, rank)
        values = rows
        parts = [(positions if r == rank else select(state.method, rows, units, density, state.seed, step, r,
                                                    state.block_size),
                  rows[r]) for r in range(world)]

    def write(target):
        accumulator = target if target.dtype == torch.float32 else torch.zeros(target.numel(), device=target.device)
        # One index_add_ per rank, in rank order: positions within a rank are
        # distinct, so every rank sums in the same order and replicas stay
        # bitwise equal (a single index_add_ with repeats is nondeterministic
        # on CUDA).
        for where, vals in parts:
            accumulator.index_add_(0, where, vals.to(accumulator.dtype))
        if accumulator is not target:
            target.copy_(accumulator)
        return [where for where, _ in parts]

    return _holds_nonfinite(values), write


def _launch(state: SparsifyState, grad: torch.Tensor, residual: Optional[torch.Tensor], units: Sequence[Unit],
            starts: torch.Tensor, marks: torch.Tensor, step: int, decay: Optional[torch.Tensor] = None,
            velocity: Optional[torch.Tensor] = None, everything: bool = False, *,
            density: Optional[float] = None, momentum=0.0) -> _Flight:
    """Select, pack and start the collective; the per-rank states are left untouched until :func:`_commit`.

    ``everything``: send every position (a warm-up step with momentum or
    weight decay in the hook). ``density``: this step's
    (:meth:`SparsifyState.density_at`, the default). ``momentum``: the
    velocity's factor, a float or one per parameter
    (:meth:`SparsifyState.send_momentum`).
    """
    if density is None:
        density = state.density_at(step)
    group, world, rank = state._group, state._world_size, state._rank
    shared = everything or state.aggregation == "allreduce"
    who = SHARED if shared else rank
    before = None
    if everything:
        positions = torch.arange(grad.numel(), device=grad.device)
    elif state.method == "topk":  # |p| in memory kept from step to step, then the positions
        magnitude, mask = state._scratch(grad.numel(), grad.device)
        _compensated(grad, _carried(residual, decay), state._scale, out=magnitude).abs_()
        positions = select_topk(magnitude, units, density, mask)
    else:  # the random selectors need no values
        positions = select(state.method, grad, units, density, state.seed, step, who, state.block_size)
    # p at the chosen positions only (the same float operations as the whole p)
    if residual is not None:
        before = residual.index_select(0, positions)
    carried = _carried(before, None if decay is None else decay.index_select(0, positions))
    values = _compensated(grad.index_select(0, positions), carried, state._scale)
    # Where no scale or decay enters the update, cancel the residual now, while the
    # lines just read are in cache: grad = -e at the sent positions makes the
    # commit's e + grad exactly 0 there, and spares it a scattered write into e.
    # (grad, the bucket, is overwritten with the result in any case.)
    cancelled = (before is not None and not everything and decay is None and state._scale is None
                 and grad.dtype == torch.float32)
    if cancelled:
        grad.scatter_(0, positions, before.neg())
    velocity_before = owner = None  # owner: the parameter of each position, found once if needed
    if velocity is not None:  # momentum in sends: w = m w + p where this rank sends
        velocity_before = velocity.index_select(0, positions)
        scaled = velocity_before if state._scale is None else velocity_before * state._scale
        if isinstance(momentum, torch.Tensor):  # one per parameter
            owner = torch.searchsorted(starts, positions, right=True) - 1
            values.addcmul_(scaled, momentum.index_select(0, owner))
        else:
            values.add_(scaled, alpha=momentum)
    hold = None
    if residual is not None:
        idle = marks == 0
        if marks.device.type != "cpu" or idle.any():  # (on CPU the host may look: usually no parameter is idle)
            if owner is None:
                owner = torch.searchsorted(starts, positions, right=True) - 1
            hold = idle[owner]
            values.masked_fill_(hold, 0.0)
    sent_values = None if velocity is None else values.clone()  # `wire` may be `values` itself, divided below
    wire = values.to(grad.dtype)
    kept = None if residual is None or wire.dtype == torch.float32 else values - wire.float()
    # A non-finite gradient anywhere in this rank's bucket reaches every rank, even at unsent positions.
    _fill_if(wire, ~torch.isfinite(marks).all(), float("nan"))
    wire.div_(world)  # divide before the collective, as PyTorch's allreduce_hook does
    k = positions.numel()
    sent_bytes = k * wire.element_size()
    dense = (grad.numel(), grad.numel() * grad.element_size())

    if shared:
        state._stats.add(k, sent_bytes, *dense)
        future = allreduce_sum(wire, group, world).then(lambda f: _shared_result(positions, f.value()))
        return _flight(grad, residual, positions, before, kept, hold, future, decay, velocity, velocity_before, sent_values, cancelled)

    index_dtype = torch.int32 if grad.numel() < 2**31 else torch.int64
    if state.method == "topk":
        payload = torch.cat([wire.view(torch.uint8), positions.to(index_dtype).view(torch.uint8)])
        sent_bytes += k * index_dtype.itemsize
    else:  # random positions are recomputed from (seed, step, unit, rank): values only
        payload = wire
    state._stats.add(k, sent_bytes, *dense)
    future = allgather(payload, group, world).then(
        lambda f: _gathered_result(state, units, step, density, positions, wire.dtype, index_dtype, f.value()))
    return _flight(grad, residual, positions, before, kept, hold, future, decay, velocity, velocity_before, sent_values, cancelled)


def _flight(grad, residual, positions, before, kept, hold, future, decay, velocity, velocity_before, sent,
            cancelled):
    flight = _Flight(grad, residual, positions, before, kept, hold, future)
    flight.decay, flight.velocity, flight.velocity_before, flight.sent = decay, velocity, velocity_before, sent
    flight.cancelled = cancelled
    return flight


def _launch_global(state: SparsifyState, step: int, density: float) -> _Flight:
    """At the last bucket: one budget over the concatenation of all buckets of the step."""
    waiting, state._waiting = state._waiting, []
    buffers = [buffer for buffer, _, _, _, _ in waiting]
    grad = torch.cat(buffers)  # receives the joined result, copied back into the buffers at the end
    layout, starts, shift = [], [], 0
    for buffer, bucket_layout, bucket_starts, _, _ in waiting:
        layout.extend((key, offset + shift, n) for key, offset, n in bucket_layout)
        starts.append(bucket_starts + shift)
        shift += buffer.numel()
    layout = tuple(layout)
    residual = velocity = None
    if state.error_feedback:
        residual = state.residuals.bucket_residual(GLOBAL_BUCKET, layout, grad.numel(), grad.device)
    momentum = state.send_momentum(layout, grad.device)
    if momentum is not None:
        velocity = state.velocities.bucket_residual(GLOBAL_BUCKET, layout, grad.numel(), grad.device)
    marks = torch.cat([m for _, _, _, m, _ in waiting])
    decay = None if state.weight_decay == 0.0 else torch.cat([d for _, _, _, _, d in waiting])
    starts = torch.cat(starts)
    flight = _launch(state, grad, residual, [Unit(0, 0, grad.numel())], starts, marks, step,
                     decay, velocity, density=density, momentum=0.0 if momentum is None else momentum)
    flight.outputs = buffers
    if state.counts_momentum_in_sends:
        flight.update = UpdateRecord(GLOBAL_BUCKET, layout, starts, 0.0 if momentum is None else momentum)
    return flight


def _update_states(flight: _Flight, discard: torch.Tensor, inv_scale: Optional[torch.Tensor]) -> None:
    """Fold the step's gradient into this rank's float32 states; a discarded step leaves them unchanged.

    The one place where the per-rank states absorb a gradient, and so where
    non-finite steps and the loss scale are handled for all of them: the
    gradient (and the weight-decay term) is zeroed when the step is
    discarded, and consumed times ``1/S``. Then ``e = e + g / S + d``
    everywhere and, at the positions sent, what was not sent (0, or the
    rounding to the wire dtype), and with momentum ``w = sent / S`` there;
    held positions (parameters without a gradient) and discarded steps keep
    ``e`` and ``w``.
    """
    e = flight.residual
    if e is None:
        return
    on_host = discard.device.type == "cpu"  # the verdict is free to read there: branch instead of masking
    if on_host and bool(discard):
        return
    grad = flight.grad
    if not on_host:
        _fill_if(grad, discard, 0.0, sync_free=True)  # the buffer is overwritten with the result next
    if inv_scale is None:
        e.add_(grad)
    else:
        e.addcmul_(grad, inv_scale)
    if flight.decay is not None:
        if not on_host:
            _fill_if(flight.decay, discard, 0.0, sync_free=True)
        e.add_(flight.decay)
    if on_host:
        keep = flight.hold
    else:
        keep = discard if flight.hold is None else flight.hold | discard
    left = flight.kept if flight.kept is None or inv_scale is None else flight.kept * inv_scale
    positions = flight.positions
    # kept positions had no gradient added (a held parameter's is 0, a discarded step's was zeroed): e before
    if keep is None:
        if left is None:
            if not flight.cancelled:  # (cancelled: e + grad is 0 at `positions` already)
                zero_at(e, positions)
        else:
            e.scatter_(0, positions, left)
    else:
        if left is None:
            left = torch.zeros((), dtype=e.dtype, device=e.device)
        e.index_put_((positions,), torch.where(keep, flight.before, left))
    if flight.velocity is not None:
        sent = flight.sent if inv_scale is None else flight.sent * inv_scale
        if keep is None:
            flight.velocity.scatter_(0, positions, sent)
        else:
            flight.velocity.index_put_((positions,), torch.where(keep, flight.velocity_before, sent))


def _commit(state: SparsifyState, flights: List[_Flight], scale: Optional[torch.Tensor]) -> None:
    """End of the step, all exchanges done: one verdict for the step, then states and outputs."""
    results = [flight.future.value() for flight in flights]
    discard = torch.stack([bad for bad, _ in results]).any()  # the same on every rank: all saw the same data
    state._count_nonfinite(discard)
    inv_scale = None if scale is None else scale.reciprocal()
    # The last update is remembered only from steps the optimizer takes (a host read off the CPU).
    applied = None if not any(f.update is not None for f in flights) else not bool(discard)
    for flight, (_, write) in zip(flights, results):
        _update_states(flight, discard, inv_scale)
        target = flight.grad.zero_() if flight.result is None else flight.result.clear()
        written = write(target)
        if flight.update is not None and applied:
            written = present_update(state.last_updates, flight.update, target, written, scale, inv_scale)
        if flight.result is not None:
            flight.result.written = written
        if flight.outputs is not None:
            for buffer, chunk in zip(flight.outputs, flight.grad.split([b.numel() for b in flight.outputs])):
                buffer.copy_(chunk)

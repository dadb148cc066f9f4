"""One exchange of :func:`~ddp_hooks.sparsify_hook`: select, pack and start the collective.

The algorithm, and the rules for non-finite steps, idle parameters, the loss
scale, momentum and weight decay, are described in :mod:`ddp_hooks.sparsify.hook`.
Here :func:`launch` takes one :class:`Piece` of work (a bucket, or with
``scope="global"`` all buckets joined), asks the selector for this rank's
positions, forms the values to send there and starts the collective; it
leaves every per-rank state untouched. It returns a :class:`Flight`: what
the end of the step (:mod:`.commit`) needs to apply the exchange once it has
finished. It runs in two halves, :func:`start` (the selection, whose own
collectives a selector may leave in flight: :class:`~.selectors.Choice`) and
:func:`send` (the values and their collective), so that the hook can start
the next bucket's selection before it waits for this one's positions. What
the exchange does depends on what the selector states
(:mod:`.selectors.base`), never on its name: AllReduce of the values when
every rank chose the same positions; AllGather otherwise, with each rank's
positions when they cannot be recomputed elsewhere.

Pure tensor work at world size 1, which is what
``bench/bench_sparsify_kernels.py`` times.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, NamedTuple, Optional, Tuple, Union

import torch

from .._internal.collectives import allgather, allreduce_sum
from .._internal.seeding import SHARED
from .error_feedback import ResidualChange, VelocityChange, carried, compensated
from .nonfinite import fill_if, holds_nonfinite
from .positions import every_position, gather, owners, put
from .selectors import Choice, SelectionRequest, Unit

__all__ = ["Piece", "Flight", "Result", "Started", "launch", "start", "send", "gather_outweighs_allreduce",
           "sends_everything", "position_dtype"]

# What an exchange yields once it has finished: whether any rank sent a
# non-finite value, and how to write the average into an all-zero target
# vector (the write returns the positions it touched).
Result = Tuple[torch.Tensor, Callable[[torch.Tensor], List[torch.Tensor]]]


class Piece(NamedTuple):
    """The work of one exchange: a flat gradient, its units and parameters, and this rank's states for it."""

    grad: torch.Tensor  # the bucket buffer (or the joined buckets); receives the result
    units: Tuple[Unit, ...]
    starts: torch.Tensor  # offsets where its parameters start (increasing)
    marks: torch.Tensor  # per parameter: 0 without a gradient, NaN non-finite, 1 otherwise (.nonfinite.scan)
    residual: Optional[torch.Tensor] = None  # float32, laid out like grad; None without error feedback
    velocity: Optional[torch.Tensor] = None  # float32, laid out like grad; None while no velocity runs
    decay: Optional[torch.Tensor] = None  # float32 weight_decay * x, laid out like grad; None without
    momentum: Union[float, torch.Tensor] = 0.0  # the velocity's factor: one, or one per parameter


@dataclass
class Flight:
    """One exchange in flight, and what the end of the step needs to apply it."""

    grad: torch.Tensor  # the gradient; receives the result unless `result` is set
    positions: torch.Tensor  # this rank's sent positions
    future: torch.futures.Future  # -> Result
    whole: bool = False  # the positions are every position in order (.positions: gathers there are copies)
    residual: Optional[ResidualChange] = None
    velocity: Optional[VelocityChange] = None
    idle: Optional[torch.Tensor] = None  # per sent position: its parameter had no gradient (nothing sent, kept)
    result: Optional[object] = None  # a .sparse_output.SparseOutput that receives the result instead of grad
    update: Optional[object] = None  # optimizer momentum counted in sends: a .last_update.UpdateRecord
    outputs: Optional[List[torch.Tensor]] = None  # global scope: the bucket buffers that receive grad's chunks


def gather_outweighs_allreduce(density: float, world_size: int, value_bytes: int, index_bytes: int) -> bool:
    r"""True when an AllGather of this density's entries moves at least the bytes of an AllReduce of all of them.

    In a ring AllGather each rank passes on the other ranks' entries,
    ``(w - 1) k (v + i)`` bytes for ``k = density * n`` entries of ``v``
    bytes with ``i`` bytes of position each (0 where positions are
    recomputed); a ring AllReduce of all ``n`` entries passes
    ``2 (w - 1) / w * n v``. So the gather costs more from
    ``density >= 2 v / (w (v + i))``: from 1/4 for top-k (float32 values,
    int32 positions) at 4 ranks, from 1/8 at 8. Such a step (early in the
    density warm-up) sends every entry of the compensated gradient by
    AllReduce instead: more than it would have selected, so error feedback
    has nothing left over, for fewer bytes on the wire and no selection.
    At ``density=1`` the AllReduce is taken at any world size.

    Example::

        >>> gather_outweighs_allreduce(0.3, 4, 4, 4), gather_outweighs_allreduce(0.2, 4, 4, 4)
        (True, False)
        >>> gather_outweighs_allreduce(0.3, 4, 4, 0), gather_outweighs_allreduce(0.5, 4, 4, 0)
        (False, True)
    """
    return density >= 1.0 or world_size * density * (value_bytes + index_bytes) >= 2 * value_bytes


def position_dtype(numel: int) -> torch.dtype:
    """The dtype positions travel in, for a gradient of ``numel`` entries: int32 where it fits."""
    return torch.int32 if numel < 2**31 else torch.int64


def sends_everything(options, density: float, world_size: int, value_bytes: int, numel: int) -> bool:
    """Whether a step of ``options`` (a :class:`~ddp_hooks.sparsify.options.SparsifyOptions`) at ``density`` sends
    every entry by AllReduce: under AllGather where :func:`gather_outweighs_allreduce`, for a gradient of
    ``numel`` entries of ``value_bytes`` each on ``world_size`` ranks."""
    if options.aggregation != "allgather":
        return False
    index_bytes = position_dtype(numel).itemsize if options.selector.positions_travel else 0
    return gather_outweighs_allreduce(density, world_size, value_bytes, index_bytes)


class Started(NamedTuple):
    """A piece whose selection has started (:func:`start`): what :func:`send` needs to finish it."""

    piece: Piece
    request: SelectionRequest
    choice: Choice  # this rank's positions, possibly still waiting for the selector's collectives
    everything: bool
    shared: bool  # every rank sends at the same positions: AllReduce


def launch(state, piece: Piece, *, step: int, density: float, everything: bool = False) -> Flight:
    """Select, pack and start the collective of ``piece``; the per-rank states are left untouched.

    ``state`` is the bound :class:`~ddp_hooks.SparsifyState`; ``density`` this
    step's (:meth:`~ddp_hooks.SparsifyState.density_at`); ``everything``:
    send every position (a warm-up step with momentum or weight decay in
    the hook). Under AllGather every position is also sent, by AllReduce,
    where the gather would move more bytes (:func:`sends_everything`).
    :func:`start` then :func:`send`, at once.
    """
    return send(state, start(state, piece, step=step, density=density, everything=everything))


def start(state, piece: Piece, *, step: int, density: float, everything: bool = False) -> Started:
    """The first half of :func:`launch`: start the selection (a selector's own collectives are left in flight)."""
    grad, residual, decay = piece.grad, piece.residual, piece.decay
    group, rank, world = state.binding
    selector = state.selector
    value_bytes = state.options.wire_dtype(grad.dtype).itemsize
    everything = everything or sends_everything(state.options, density, world, value_bytes, grad.numel())
    shared = everything or state.options.aggregation == "allreduce"
    request = SelectionRequest(units=piece.units, density=density, seed=state.options.seed, step=step,
                               rank=SHARED if shared else rank, device=grad.device, group=group, world_size=world)
    if everything:
        choice = Choice.ready(every_position(grad.numel(), grad.device))
    else:
        if selector.reads_values:  # |p| in memory kept from step to step
            magnitude, mask = state.scratch.take(grad.numel(), grad.device)
            compensated(grad, carried(residual, decay), state.run.scale, out=magnitude).abs_()
            request = request._replace(magnitude=magnitude, scratch_mask=mask)
        choice = selector.start(request)
        if selector.communicates:  # count the bytes of the selector's own collectives
            state.counters.add(0, selector.agreement_bytes(request), 0, 0)
    # |p| is scratch memory that the next piece's selection reuses: the request kept for send() forgets it
    return Started(piece=piece, request=request._replace(magnitude=None, scratch_mask=None), choice=choice,
                   everything=everything, shared=shared)


def send(state, started: Started) -> Flight:
    """The second half of :func:`launch`: wait for the positions, pack the values and start the collective."""
    piece, request, everything, shared = started.piece, started.request, started.everything, started.shared
    grad, residual, velocity, decay = piece.grad, piece.residual, piece.velocity, piece.decay
    group, rank, world = state.binding
    selector, scale = state.selector, state.run.scale
    positions = started.choice.wait()
    # p at the chosen positions only (the same float operations as the whole p); sent whole, the states
    # themselves, read here and by the commit before it writes them
    before = None if residual is None else gather(residual, positions, everything)
    grad_at = gather(grad, positions, everything)
    values = compensated(grad_at, carried(before, None if decay is None else gather(decay, positions, everything)),
                         scale)
    if values is grad_at and everything:  # nothing carried: the bucket itself, which `values` must not change
        values = values.clone()
    # Where no scale or decay enters the update, cancel the residual now, while the
    # lines just read are in cache: grad = -e at the sent positions makes the
    # commit's e + grad exactly 0 there, and spares it a scattered write into e.
    # (grad, the bucket, is overwritten with the result in any case.)
    wire_dtype = state.options.wire_dtype(grad.dtype)
    cancelled = (before is not None and not everything and decay is None and scale is None
                 and grad.dtype == torch.float32 and wire_dtype == torch.float32)
    if cancelled:
        put(grad, positions, before.neg(), whole=False)
    velocity_before = owner = None  # owner: the parameter of each position, found once if needed
    if velocity is not None:  # momentum in sends: w = m w + p where this rank sends
        velocity_before = gather(velocity, positions, everything)
        scaled = velocity_before if scale is None else velocity_before * scale
        if isinstance(piece.momentum, torch.Tensor):  # one per parameter
            owner = owners(piece.starts, positions, grad.numel(), everything)
            values.addcmul_(scaled, piece.momentum.index_select(0, owner))
        else:
            values.add_(scaled, alpha=piece.momentum)
    idle = None
    if residual is not None:
        no_gradient = piece.marks == 0
        if piece.marks.device.type != "cpu" or no_gradient.any():  # (on the CPU the host may look: usually none)
            if owner is None:
                owner = owners(piece.starts, positions, grad.numel(), everything)
            idle = no_gradient[owner]
            values.masked_fill_(idle, 0.0)
    sent = None if velocity is None else values.clone()  # `wire` may be `values` itself, divided below
    wire = values.to(wire_dtype)
    flight = Flight(grad=grad, positions=positions, future=None, whole=everything, idle=idle)
    if residual is not None:
        flight.residual = ResidualChange(vector=residual, before=before, cancelled=cancelled, decay=decay,
                                         rounding=None if wire.dtype == torch.float32 else values - wire.float())
    if velocity is not None:
        flight.velocity = VelocityChange(vector=velocity, before=velocity_before, sent=sent)
    # A non-finite gradient anywhere in this rank's bucket reaches every rank, even at unsent positions.
    fill_if(wire, ~torch.isfinite(piece.marks).all(), float("nan"))
    wire.div_(world)  # divide before the collective, as PyTorch's allreduce_hook does
    k = positions.numel()
    sent_bytes = k * wire.element_size()
    dense = (grad.numel(), grad.numel() * grad.element_size())
    if shared:
        state.counters.add(k, sent_bytes, *dense)
        flight.future = allreduce_sum(wire, group, world).then(
            lambda f: _shared_result(positions, f.value(), everything))
        return flight
    index_dtype = position_dtype(grad.numel())
    if selector.positions_travel:
        payload = torch.cat([wire.view(torch.uint8), positions.to(index_dtype).view(torch.uint8)])
        sent_bytes += k * index_dtype.itemsize
    else:  # every rank recomputes the others' positions from (seed, step, unit, rank): values only
        payload = wire
    state.counters.add(k, sent_bytes, *dense)

    def gathered(f):
        if selector.positions_travel:
            return _gathered_result(f.value(), positions, k, wire.dtype, index_dtype)
        return _recomputed_result(f.value(), positions, request, rank, selector)

    flight.future = allgather(payload, group, world).then(gathered)
    return flight


def _shared_result(positions: torch.Tensor, received: torch.Tensor, whole: bool) -> Result:
    def write(target):
        put(target, positions, received.to(target.dtype), whole)
        return [positions]

    return holds_nonfinite(received), write


def _gathered_result(rows: torch.Tensor, positions: torch.Tensor, k: int, value_dtype: torch.dtype,
                     index_dtype: torch.dtype) -> Result:
    """Each rank's row holds its k values, then its k positions (bytes)."""
    value_bytes = k * value_dtype.itemsize
    values = rows[:, :value_bytes].view(value_dtype)
    # clone(): a row's index bytes need not start at a multiple of the index size
    parts = [(rows[r, value_bytes:].clone().view(index_dtype).long(), values[r]) for r in range(rows.shape[0])]
    return holds_nonfinite(values), _summing_write(parts)


def _recomputed_result(rows: torch.Tensor, positions: torch.Tensor, request: SelectionRequest, rank: int,
                       selector) -> Result:
    """Each rank's row holds its values; its positions are chosen again here from ``(seed, step, unit, rank)``."""
    parts = [(positions if r == rank else selector.select(request._replace(rank=r)), rows[r])
             for r in range(rows.shape[0])]
    return holds_nonfinite(rows), _summing_write(parts)


def _summing_write(parts):
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

    return write

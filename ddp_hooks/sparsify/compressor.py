r"""The sparsifying compressor: a flat gradient, its layout and a process group in, the averaged sparse result out.

One exchange of one flat gradient ``g`` (a DDP bucket, all buckets of a
step, a shard, a pseudo-gradient) runs six stages, each a method named for
it, in this order (:meth:`SparseCompressor.exchange` runs them in one call):

1. **compensate**: ``p = g + S (e + d)`` with the float32 residual ``e`` of
   error feedback (Eghlidi & Jaggi 2020, arXiv 2009.09271), ``d = wd * x``
   the hook's weight decay and ``S`` the loss scale (1 without a scaler);
   only its magnitude ``|p|`` is formed in full, for selectors that read it;
2. **select**: ``k = ceil(density * n)`` positions per unit
   (:mod:`~ddp_hooks.sparsify.selectors`); a selector that agrees on them by
   collectives of its own may leave those in flight;
3. **pack**: ``p`` at those positions (plus ``m w`` with a velocity ``w``
   that steps only where the rank sends), NaN if the rank's gradient held a
   non-finite value, divided by the world size, in the wire dtype;
4. **communicate**: AllReduce when every rank chose the same positions,
   AllGather otherwise (with each rank's positions where they cannot be
   recomputed elsewhere); the collective's own future is kept;
5. **unpack**: once the collective has finished, what arrived is read as
   each rank's positions and values (recomputed positions drawn here, not in
   the backend's callback), and whether any rank sent a non-finite value;
6. **fold**: what was not sent stays, ``e = p - c`` (``c`` the sent values;
   the wire dtype's rounding stays too), and the velocity takes what was
   sent; a discarded step (any rank's gradient non-finite) leaves both as
   they were. Then the average is **written** into an all-zero target (a sum
   per rank, in rank order, under AllGather): after the fold, which reads
   the gradient the target may be.

The recursion per rank, with ``S_t`` the positions it sends (residual
``e`` and velocity ``w`` start at 0, float32):

.. math:: p_t = g_t + e_t,\quad w_{t+1}[S_t] = m\,w_t[S_t] + p_t[S_t],\quad
          c_t = w_{t+1} \text{ on } S_t,\quad e_{t+1} = p_t \text{ off } S_t,\ 0 \text{ on } S_t,
          \quad \hat g_t = \tfrac{1}{W}\textstyle\sum_{r} c_t^{(r)}

and ``w`` keeps its value off ``S_t`` (``m = 0``: plain error feedback). So
every gradient reaches the model exactly once, plus momentum's carry at each
send: :math:`\sum_{s\le t} c_s + e_{t+1} = \sum_{s\le t} g_s + m \sum_{s\le t}
w_s[S_s]`. Momentum counts *sends*, not steps: with a random selector a
coordinate leaves about once every ``1 / density`` steps with that many
gradients, and a velocity stepped every step would multiply that burst by
``1 / (1 - m)`` (``bench/README.md`` measures the divergence); in send time
the burst is one heavy-ball step. At density 1 this is momentum SGD.

A carrier (the DDP hook, :mod:`.hook`) may split the stages: :meth:`begin`
(compensate, select), :meth:`send` (pack, communicate), :meth:`unpack` (what
arrived, and whether any of it is non-finite) and :meth:`finish` (fold,
write), so that it can start a bucket's selection before the last one's
positions have arrived and decide one verdict for a whole step.

**Futures** follow PyTorch's CUDA semantics: a :class:`PendingExchange`
keeps the collective's own future, whose output is read only after
``wait()`` (which makes the current stream wait for the collective's) or
inside a callback chained on that very future (which PyTorch runs on a
stream that waited). The DDP carrier computes nothing in a backend's
callback; :meth:`exchange` unpacks, folds and writes in one chained on the
collective's future, on that stream, whose event the returned future holds.

**No host syncs** where the device would stall: a branch that reads a tensor
on the host is taken only where :func:`host_reads_free` says so (the CPU).

Example (one process: the average is the rank's own sparse gradient)::

    >>> import os, tempfile, torch, torch.distributed as dist
    >>> from ddp_hooks.sparsify.options import SparsifyOptions
    >>> from ddp_hooks.sparsify.selectors import Unit
    >>> store = os.path.join(tempfile.mkdtemp(), "store")
    >>> dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    >>> compressor = SparseCompressor(SparsifyOptions(method="random_block", density=0.1))
    >>> g = torch.arange(1.0, 21.0)
    >>> layout = ((0, 0, 10), (1, 10, 10))   # two parameters: (key, offset, numel)
    >>> average = compressor.exchange(g.clone(), layout, group=None, step=0, density=0.1).wait()
    >>> int((average != 0).sum()), float(average.sum() + compressor.residuals.total())   # nothing lost
    (2, 210.0)
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from ..stats import CommStats
from .memory import GLOBAL_BUCKET, Layout, ResidualStore, ScratchMemory, every_position, gather, owners, put, zero_at
from .selectors import Choice, SelectionRequest, Unit
from .selectors.draws import SHARED

__all__ = ["SparseCompressor", "PendingExchange", "units_of", "host_reads_free", "holds_nonfinite", "fill_if",
           "gather_outweighs_allreduce", "sends_everything", "position_dtype"]

#: Read tensors on the host where that is free (the CPU). Tests set it to False to run, on the CPU, the
#: form every other device takes, and count its host syncs.
HOST_READS_ON_CPU = True


def host_reads_free(device: torch.device) -> bool:
    """Whether a branch may read a tensor of ``device`` on the host: on the CPU (a stall of the stream elsewhere)."""
    return HOST_READS_ON_CPU and device.type == "cpu"


def fill_if(tensor: torch.Tensor, flag: torch.Tensor, value: float) -> None:
    """``tensor.fill_(value)`` if the 0-dim bool ``flag`` is set: read on the host where free, else masked."""
    if not host_reads_free(flag.device):
        tensor.masked_fill_(flag, value)
    elif flag:
        tensor.fill_(value)


def holds_nonfinite(received: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool tensor: ``received`` holds an inf or NaN.

    Where the host may read, one float32 sum decides when it is finite (an
    inf or NaN propagates into it); only a sum that is not finite, which an
    overflow can also cause, is followed by the elementwise check.
    """
    if host_reads_free(received.device) and bool(torch.isfinite(received.sum(dtype=torch.float32))):
        return torch.zeros((), dtype=torch.bool)
    return ~torch.isfinite(received).all()


def gather_outweighs_allreduce(density: float, world_size: int, value_bytes: int, index_bytes: int) -> bool:
    r"""True when an AllGather of this density's entries moves at least the bytes of an AllReduce of all of them.

    In a ring AllGather each rank passes on the other ranks' entries,
    ``(w - 1) k (v + i)`` bytes for ``k = density * n`` entries of ``v``
    bytes with ``i`` bytes of position each (0 where positions are
    recomputed); a ring AllReduce of all ``n`` entries passes
    ``2 (w - 1) / w * n v``. So the gather costs more from
    ``density >= 2 v / (w (v + i))``: from 1/4 for top-k (float32 values,
    int32 positions) at 4 ranks. Such a step (early in the density warm-up)
    sends every entry of ``p`` by AllReduce instead: error feedback then has
    nothing left over. At ``density=1`` the AllReduce is taken at any world size.

    Example::

        >>> gather_outweighs_allreduce(0.3, 4, 4, 4), gather_outweighs_allreduce(0.2, 4, 4, 4)
        (True, False)
    """
    return density >= 1.0 or world_size * density * (value_bytes + index_bytes) >= 2 * value_bytes


def position_dtype(numel: int) -> torch.dtype:
    """The dtype positions travel in, for a gradient of ``numel`` entries: int32 where it fits."""
    return torch.int32 if numel < 2**31 else torch.int64


def sends_everything(options, density: float, world_size: int, value_bytes: int, numel: int) -> bool:
    """Whether a step of ``options`` at ``density`` sends every entry by AllReduce (:func:`gather_outweighs_allreduce`)."""
    if options.aggregation != "allgather":
        return False
    index_bytes = position_dtype(numel).itemsize if options.selector.positions_travel else 0
    return gather_outweighs_allreduce(density, world_size, value_bytes, index_bytes)


@dataclass(eq=False)
class PendingExchange:
    """One exchange between its stages: what each stage hands on to the next, and what the fold needs."""

    grad: torch.Tensor  # the flat gradient
    starts: torch.Tensor  # offsets where its parameters start (increasing)
    marks: Optional[torch.Tensor]  # per parameter: 0 without a gradient, NaN non-finite, 1 (None: all 1)
    residual: Optional[torch.Tensor]  # e, float32, laid out like grad; None without error feedback
    velocity: Optional[torch.Tensor]  # w, float32, laid out like grad; None while no velocity runs
    decay: Optional[torch.Tensor]  # weight_decay * x, float32; None without
    momentum: Union[float, torch.Tensor]  # the velocity's factor: one, or one per parameter
    scale: Optional[torch.Tensor]  # the loss scale S (0-dim), or None
    request: SelectionRequest
    choice: Choice  # this rank's positions, possibly waiting for the selector's collectives
    dense: bool  # every position is sent, in order (gathers and scatters are copies)
    shared: bool  # every rank sends at the same positions: AllReduce
    group: object = None
    positions: Optional[torch.Tensor] = None  # pack: this rank's positions
    residual_before: Optional[torch.Tensor] = None  # pack: e at the positions
    cancelled: bool = False  # pack: grad holds -e at the positions already (e + g is 0 there)
    rounding: Optional[torch.Tensor] = None  # pack: p - round(p) at the positions (half wire dtypes)
    velocity_before: Optional[torch.Tensor] = None  # pack: w at the positions
    sent: Optional[torch.Tensor] = None  # pack: the float32 values sent (scaled), for the velocity
    idle: Optional[torch.Tensor] = None  # pack: per position, its parameter had no gradient
    wire_dtype: Optional[torch.dtype] = None
    future: Optional[torch.futures.Future] = None  # communicate: the collective's own future
    arrival: Optional[torch.Tensor] = None  # communicate: what the collective writes (read after future.wait())


class SparseCompressor:
    """Top-k, random-k, random-block or shared top-k with error feedback, for any flat gradient.

    Args:
        options (SparsifyOptions): the method, density, aggregation, value
            dtype and the rest (:class:`~ddp_hooks.sparsify.options.SparsifyOptions`).
        counters (CommStats): where the entries and bytes sent are counted
            (a new one by default).

    The residuals and velocities are kept per parameter key
    (:class:`~.memory.ResidualStore`), on the gradient's device.
    """

    def __init__(self, options, counters: Optional[CommStats] = None) -> None:
        self.options = options
        self.selector = options.selector
        self.residuals = ResidualStore()
        self.velocities = ResidualStore()  # per rank, like the residuals; used while a velocity runs
        self.scratch = ScratchMemory()  # |p| and top-k's candidate mask, kept from step to step
        self.counters = CommStats() if counters is None else counters

    # ----- all six stages in one call -----
    def exchange(self, grad: torch.Tensor, layout: Layout, group, *, step: int, density: float,
                 key: int = 0, momentum: Optional[float] = None, everything: bool = False) -> torch.futures.Future:
        """Average ``grad`` (flat, laid out as ``layout``) over ``group``, sparsely; the future holds ``grad``.

        Each parameter of ``layout`` is a unit with its own budget; a step
        whose ``grad`` holds inf or NaN on some rank is discarded on every
        rank (``grad`` then holds NaN, the residuals keep their values). Wait
        for the returned future (or chain on it) before the next exchange of
        the same ``key``: its fold writes the residual that one reads.
        ``momentum``: a velocity counted in sends; ``everything``: send every
        entry (:meth:`begin`).
        """
        units, starts = units_of(layout, "layer", key, grad.numel()), _starts(layout, grad.device)
        marks = torch.where(torch.isfinite(grad).all(), 1.0, float("nan")).expand(len(layout))  # no idle parameter
        pending = self.begin(grad, units, starts, marks, key=key, layout=layout, group=group, step=step,
                             density=density, momentum=momentum, everything=everything)
        self.send(pending)

        def fold_and_write(_):
            bad, parts = self.unpack(pending)
            self.finish(pending, parts, discard=bad)
            return grad

        return pending.future.then(fold_and_write)

    # ----- stages 1 and 2 -----
    def begin(self, grad: torch.Tensor, units: Sequence[Unit], starts: torch.Tensor, marks: Optional[torch.Tensor],
              *, key: int, layout: Layout, group, step: int, density: float, scale: Optional[torch.Tensor] = None,
              decay: Optional[torch.Tensor] = None, momentum: Union[None, float, torch.Tensor] = None,
              everything: bool = False) -> PendingExchange:
        """Compensate and select: the exchange of ``grad`` under ``key`` started, its states untouched.

        ``momentum`` None: no velocity; ``everything``: send every position
        (under AllGather also where the gather would cost more, :func:`sends_everything`).
        """
        group = dist.group.WORLD if group is None else group  # (what a selector's own collectives name)
        options, world = self.options, dist.get_world_size(group)
        residual = velocity = None
        if options.error_feedback:
            residual = self.residuals.bucket_residual(key, layout, grad.numel(), grad.device)
        if momentum is not None:
            velocity = self.velocities.bucket_residual(key, layout, grad.numel(), grad.device)
        value_bytes = options.wire_dtype(grad.dtype).itemsize
        everything = everything or sends_everything(options, density, world, value_bytes, grad.numel())
        shared = everything or options.aggregation == "allreduce"
        request = SelectionRequest(units=tuple(units), density=density, seed=options.seed, step=step,
                                   rank=SHARED if shared else dist.get_rank(group), device=grad.device, group=group,
                                   world_size=world, host_reads=host_reads_free(grad.device))
        pending = PendingExchange(grad=grad, starts=starts, marks=marks, residual=residual, velocity=velocity,
                                  decay=decay, momentum=0.0 if momentum is None else momentum, scale=scale,
                                  request=request, choice=None, dense=everything, shared=shared, group=group)
        pending.choice = self.select(pending)
        return pending

    def compensate(self, pending: PendingExchange, out: Optional[torch.Tensor] = None,
                   at: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``p = g + S (e + d)`` in float32: in full (into ``out``), or at the positions ``at`` only."""
        dense = pending.dense
        grad = pending.grad if at is None else gather(pending.grad, at, dense)
        carry = pending.residual if at is None or pending.residual is None else pending.residual_before
        decay = pending.decay if at is None or pending.decay is None else gather(pending.decay, at, dense)
        if decay is not None:
            carry = decay if carry is None else carry + decay
        if carry is None:
            return grad.float() if out is None else out.copy_(grad)
        if pending.scale is None:
            return torch.add(carry, grad, out=out)
        return torch.addcmul(grad.float(), carry, pending.scale, out=out)

    def select(self, pending: PendingExchange) -> Choice:
        """This rank's positions, as a :class:`Choice` (a selector's own collectives may be left in flight)."""
        request = pending.request
        if pending.dense:
            return Choice.ready(every_position(pending.grad.numel(), pending.grad.device))
        if self.selector.reads_values:  # |p|, into memory kept from step to step
            magnitude, mask = self.scratch.take(pending.grad.numel(), pending.grad.device)
            self.compensate(pending, out=magnitude).abs_()
            request = request._replace(magnitude=magnitude, scratch_mask=mask)
        choice = self.selector.start(request)
        if self.selector.communicates:
            _count(self.counters, 0, self.selector.agreement_bytes(request), 0, 0)
        return choice  # (the request kept in `pending` forgets |p|: the next selection reuses its memory)

    # ----- stages 3 and 4 -----
    def send(self, pending: PendingExchange) -> None:
        """Pack and communicate: wait for the positions, form the values to send there, start the collective."""
        self.communicate(pending, self.pack(pending))

    def pack(self, pending: PendingExchange) -> torch.Tensor:
        """The values this rank sends at its positions: ``p`` (plus ``m w``), divided by the world size."""
        grad, residual, velocity, dense = pending.grad, pending.residual, pending.velocity, pending.dense
        positions = pending.positions = pending.choice.wait()
        # p at the chosen positions only (the same float operations as the whole p); sent whole, the states
        # themselves, read here and by the fold before it writes them
        pending.residual_before = None if residual is None else gather(residual, positions, dense)
        values = self.compensate(pending, at=positions)
        if values is grad and dense:  # nothing carried: the gradient itself, which `values` must not change
            values = values.clone()
        wire_dtype = pending.wire_dtype = self.options.wire_dtype(grad.dtype)
        # Where no scale or decay enters the update, cancel the residual now, while the lines just read are
        # in cache: grad = -e at the sent positions makes the fold's e + grad exactly 0 there, and spares it
        # a scattered write into e (grad is overwritten with the result in any case).
        pending.cancelled = (residual is not None and not dense and pending.decay is None and pending.scale is None
                             and grad.dtype == torch.float32 and wire_dtype == torch.float32)
        if pending.cancelled:
            put(grad, positions, pending.residual_before.neg(), whole=False)
        owner = None  # the parameter of each position, found once if needed
        if velocity is not None:  # momentum in sends: w = m w + p where this rank sends
            before = pending.velocity_before = gather(velocity, positions, dense)
            scaled = before if pending.scale is None else before * pending.scale
            if isinstance(pending.momentum, torch.Tensor):  # one per parameter
                owner = owners(pending.starts, positions, grad.numel(), dense)
                values.addcmul_(scaled, pending.momentum.index_select(0, owner))
            else:
                values.add_(scaled, alpha=pending.momentum)
        marks = pending.marks
        if residual is not None and marks is not None:
            no_gradient = marks == 0
            if not host_reads_free(marks.device) or no_gradient.any():  # (where free, the host looks first)
                if owner is None:
                    owner = owners(pending.starts, positions, grad.numel(), dense)
                pending.idle = no_gradient[owner]
                values.masked_fill_(pending.idle, 0.0)
        pending.sent = None if velocity is None else values.clone()  # `wire` may be `values`, divided below
        wire = values.to(wire_dtype)
        if residual is not None and wire.dtype != torch.float32:
            pending.rounding = values - wire.float()
        if marks is not None:  # a non-finite gradient anywhere in this rank's piece reaches every rank
            fill_if(wire, ~torch.isfinite(marks).all(), float("nan"))
        wire.div_(pending.request.world_size)  # divide before the collective, as PyTorch's allreduce_hook does
        return wire

    def communicate(self, pending: PendingExchange, wire: torch.Tensor) -> None:
        """Start the collective of the packed values (never skipped, even for one rank); keep its future."""
        grad, positions, group = pending.grad, pending.positions, pending.group
        k, n = positions.numel(), grad.numel()
        sent_bytes = k * wire.element_size()
        if pending.shared:
            _count(self.counters, k, sent_bytes, n, n * grad.element_size())
            pending.arrival = wire
            pending.future = dist.all_reduce(wire, group=group, async_op=True).get_future()
        else:
            payload = wire
            if self.selector.positions_travel:
                index_dtype = position_dtype(n)
                payload = torch.cat([wire.view(torch.uint8), positions.to(index_dtype).view(torch.uint8)])
                sent_bytes += k * index_dtype.itemsize
            # (else every rank recomputes the others' positions from (seed, step, unit, rank): values only)
            _count(self.counters, k, sent_bytes, n, n * grad.element_size())
            world = pending.request.world_size
            pending.arrival = torch.empty(world, payload.numel(), dtype=payload.dtype, device=payload.device)
            pending.future = _all_gather_into(pending.arrival.view(-1), payload, group).get_future()
        # The exchange lets go of the process group once its collective is launched: what unpacks and folds
        # it may run in a callback on the backend's own thread, and were the last reference to the group
        # dropped there, its destructor would join that very thread (gloo aborts: "Resource deadlock avoided").
        pending.group, pending.request = None, pending.request._replace(group=None)

    # ----- stages 5 and 6 -----
    def unpack(self, pending: PendingExchange) -> Tuple[torch.Tensor, List[Tuple[torch.Tensor, torch.Tensor]]]:
        """Once the collective has finished: whether any rank sent a non-finite value, and each rank's
        ``(positions, values)`` (one pair, the sum, under AllReduce).

        ``wait()`` on the collective's future: on a GPU it makes the current
        stream wait for the collective's, wherever this runs.
        """
        pending.future.wait()
        rows, positions, world = pending.arrival, pending.positions, pending.request.world_size
        if pending.shared:
            return holds_nonfinite(rows), [(positions, rows)]
        if not self.selector.positions_travel:  # each rank's positions, chosen again from (seed, step, unit, rank)
            me = pending.request.rank
            return holds_nonfinite(rows), [(positions if r == me else self.selector.select(
                pending.request._replace(rank=r)), rows[r]) for r in range(world)]
        value_bytes = positions.numel() * pending.wire_dtype.itemsize
        values = rows[:, :value_bytes].view(pending.wire_dtype)
        index_dtype = position_dtype(pending.grad.numel())
        # clone(): a row's index bytes need not start at a multiple of the index size
        return holds_nonfinite(values), [(rows[r, value_bytes:].clone().view(index_dtype).long(), values[r])
                                         for r in range(world)]

    def finish(self, pending: PendingExchange, parts, *, discard: torch.Tensor,
               target: Optional[torch.Tensor] = None, inv_scale: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
        """Fold, then write the average into ``target``; returns the positions written.

        ``target``: a vector holding zeros where the step does not write (a
        whole step writes everywhere); by default the gradient, zeroed once
        the fold has read it.
        """
        if pending.residual is not None:
            self.fold(pending, discard=discard, inv_scale=inv_scale, beta=self.options.error_feedback_beta)
        if target is None:
            target = pending.grad if pending.dense else pending.grad.zero_()
        return self.write(pending, parts, target)

    def write(self, pending: PendingExchange, parts, target: torch.Tensor) -> List[torch.Tensor]:
        """Write the average into the all-zero ``target``; returns the positions written, one tensor per part."""
        if pending.shared:
            (positions, received), = parts
            put(target, positions, received.to(target.dtype), pending.dense)
            return [positions]
        accumulator = target if target.dtype == torch.float32 else torch.zeros(target.numel(), device=target.device)
        # One index_add_ per rank, in rank order: positions within a rank are distinct, so every rank sums in
        # the same order and replicas stay bitwise equal (one index_add_ with repeats is nondeterministic on CUDA).
        for where, values in parts:
            accumulator.index_add_(0, where, values.to(accumulator.dtype))
        if accumulator is not target:
            target.copy_(accumulator)
        return [where for where, _ in parts]

    def fold(self, pending: PendingExchange, *, discard: torch.Tensor, inv_scale: Optional[torch.Tensor] = None,
             beta: float = 1.0) -> None:
        """Fold the step's gradient into this rank's float32 states; a discarded step leaves them unchanged.

        The one place where the per-rank states absorb a gradient: ``g``
        (and ``d``) is zeroed when the step is discarded (``discard``, a
        0-dim bool) and consumed times ``1/S``. Then ``e = e + g / S + d``
        everywhere and, at the sent positions, what was not sent (0, or the
        rounding to the wire dtype), and with a velocity ``w = sent / S``
        there. Positions whose parameter had no gradient (``idle``) and
        discarded steps keep ``e`` and ``w``. With ``beta`` < 1 (ScaleCom's
        low-pass filter) ``e + beta g / S`` where nothing was sent and
        ``(1 - beta) e + beta r`` where it was. ``grad`` may be overwritten.
        """
        e, grad, positions, whole = pending.residual, pending.grad, pending.positions, pending.dense
        decay, before = pending.decay, pending.residual_before
        on_host = host_reads_free(discard.device)  # the verdict is free to read there: branch instead of masking
        if on_host and bool(discard):
            return
        if not on_host:
            grad.masked_fill_(discard, 0.0)
            if decay is not None:
                decay.masked_fill_(discard, 0.0)
        if not whole:  # (sent whole, e is overwritten at every position below)
            if inv_scale is not None and beta == 1.0:
                e.addcmul_(grad, inv_scale)
            else:
                e.add_(grad if inv_scale is None else grad * inv_scale, alpha=beta)
            if decay is not None:
                e.add_(decay, alpha=beta)
        # positions whose states keep their values (a parameter without a gradient; on a device, a discarded
        # step); they had no gradient added (an idle parameter's is 0, a discarded step's was zeroed): e before
        idle = pending.idle
        frozen = idle if on_host else (discard if idle is None else idle | discard)
        remainder = pending.rounding
        if remainder is not None and inv_scale is not None:
            remainder = remainder * inv_scale
        if beta != 1.0:  # (1 - beta) e_before + beta r at the sent positions
            left = before * (1.0 - beta)
            if remainder is not None:
                left.add_(remainder, alpha=beta)
            put(e, positions, left if frozen is None else torch.where(frozen, before, left), whole)
        elif frozen is None:
            if remainder is None:
                if not pending.cancelled:  # (cancelled: e + grad is 0 at the positions already)
                    zero_at(e, positions, whole)
            else:
                put(e, positions, remainder, whole)
        else:
            if remainder is None:
                remainder = torch.zeros((), dtype=e.dtype, device=e.device)
            put(e, positions, torch.where(frozen, before, remainder), whole)
        if pending.velocity is not None:
            sent = pending.sent if inv_scale is None else pending.sent * inv_scale
            put(pending.velocity, positions,
                sent if frozen is None else torch.where(frozen, pending.velocity_before, sent), whole)


@lru_cache(maxsize=1024)
def units_of(layout: Layout, scope: str, key: int, numel: int) -> Tuple[Unit, ...]:
    """The units of selection of a bucket ``key`` or of all (GLOBAL_BUCKET), kept: a layout repeats every step.

    Layer scope: one per parameter, keyed by the parameter (an empty one has
    no budget); else one for the whole vector, keyed by its bucket (0 for all).
    """
    if scope == "layer":
        return tuple(Unit(param, offset, n) for param, offset, n in layout if n)
    return (Unit(0 if key == GLOBAL_BUCKET else key, 0, numel),)


@lru_cache(maxsize=256)
def _starts(layout: Layout, device: torch.device) -> torch.Tensor:
    """The offsets where a layout's parameters start, on ``device`` (kept: no copy per call)."""
    return torch.tensor([offset for _, offset, _ in layout], dtype=torch.int64, device=device)


def _count(counters: CommStats, elements: int, sent_bytes: int, elements_dense: int, bytes_dense: int) -> None:
    # CommStats.add, written out: one bucket's path stays within the sparsifier's own modules
    counters.elements_sent += elements
    counters.bytes_sent += sent_bytes
    counters.elements_dense += elements_dense
    counters.bytes_dense += bytes_dense


def _all_gather_into(output: torch.Tensor, tensor: torch.Tensor, group):
    # torch >= 2.14 names it all_gather_single; older releases all_gather_into_tensor.
    gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather_into(output, tensor, group=group, async_op=True)

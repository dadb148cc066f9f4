r"""The sparsifying DDP communication hook: top-k, random-k and random-block-k with error feedback.

Per rank, per step, for each unit of selection (a layer, the bucket, or all
buckets: :class:`~ddp_hooks.SparsifyState`'s ``scope``), following Eghlidi &
Jaggi, "Sparse Communication for Training Deep Networks" (2020,
arXiv 2009.09271):

1. Compensate: ``p = g + e`` in place in the float32 residual of the bucket
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
   elsewhere), as PyTorch's own hooks do.

The step counter advances on the last bucket of each backward; with
``scope="global"`` every bucket's future is completed when the last bucket's
exchange finishes (DDP waits for all of them only at the end of backward).

Example (one process, so the average is the rank's own sparse gradient)::

    >>> import os, tempfile, torch, torch.distributed as dist
    >>> from torch.nn.parallel import DistributedDataParallel as DDP
    >>> from ddp_hooks import SparsifyState, sparsify_hook
    >>> store = os.path.join(tempfile.mkdtemp(), "store")
    >>> dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    >>> model = DDP(torch.nn.Linear(100, 10))
    >>> state = SparsifyState(method="random_block", density=0.1)
    >>> model.register_comm_hook(state, sparsify_hook)
    >>> model(torch.randn(8, 100)).sum().backward()
    >>> int((model.module.weight.grad != 0).sum())   # ceil(0.1 * 1000)
    100
    >>> state.stats()["steps"]
    1
    >>> dist.destroy_process_group()
"""

from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from .collectives import allgather, allreduce_mean, allreduce_sum
from .seeding import SHARED
from .selection import Unit, select
from .sparsify_state import SparsifyState

__all__ = ["sparsify_hook"]


def _gradient_term(state: SparsifyState, bucket: dist.GradBucket, layout) -> torch.Tensor:
    """The bucket's gradient, plus ``weight_decay * x`` (as a float32 copy) when the hook applies weight decay."""
    buffer = bucket.buffer()
    if state.weight_decay == 0.0:
        return buffer
    term = buffer.to(torch.float32, copy=True)
    for param, (_, offset, n) in zip(bucket.parameters(), layout):
        term[offset : offset + n].add_(param.detach().reshape(-1), alpha=state.weight_decay)
    return term


def _compensated(state: SparsifyState, bucket: dist.GradBucket, layout) -> torch.Tensor:
    """``p = g + e`` as float32 (``g``: :func:`_gradient_term`): the residual itself, updated in place, under error feedback."""
    term = _gradient_term(state, bucket, layout)
    if state.error_feedback:
        buffer = bucket.buffer()
        residual = state.residuals.bucket_residual(bucket.index(), layout, buffer.numel(), buffer.device)
        return residual.add_(term)
    return term if term.dtype == torch.float32 else term.float()


def _bucket_velocity(state: SparsifyState, bucket: dist.GradBucket, layout) -> torch.Tensor:
    buffer = bucket.buffer()
    return state.velocities.bucket_residual(bucket.index(), layout, buffer.numel(), buffer.device)


def _dense_warmup_term(state: SparsifyState, bucket: dist.GradBucket, layout) -> None:
    """During warm-up with momentum or weight decay in the hook: send everything (the optimizer has neither).

    Every position is sent, so with momentum the velocity steps everywhere:
    ``w = m w + p``, and ``w`` is what the bucket carries.
    """
    buffer = bucket.buffer()
    p = _compensated(state, bucket, layout)
    send = p
    if state.momentum > 0.0:
        send = _bucket_velocity(state, bucket, layout).mul_(state.momentum).add_(p)
    buffer.copy_(send)
    if state.error_feedback:  # the residual keeps only what rounding to the bucket's dtype lost
        if send is not p:
            p.copy_(send)
        p.sub_(buffer)


def _sent_values(state: SparsifyState, p: torch.Tensor, velocity: Optional[torch.Tensor], positions: torch.Tensor):
    """What leaves at ``positions``: ``p`` there, or with momentum the velocity stepped there, ``w = m w + p``.

    The velocity moves only where something is sent: a coordinate that stays
    behind keeps its velocity for its next send, so momentum counts sends, not
    steps, and a burst that gathered many steps of gradient is not multiplied
    by ``1 / (1 - m)`` again at every step it waited.
    """
    values = p.index_select(0, positions)
    if velocity is not None:
        values.add_(velocity.index_select(0, positions), alpha=state.momentum)
        velocity.index_copy_(0, positions, values)
    return values


def _exchange(state: SparsifyState, p: torch.Tensor, units: Sequence[Unit], target: torch.Tensor, step: int,
              velocity: Optional[torch.Tensor] = None):
    """Select, update the residual (and velocity), launch the collective; the future writes the mean into ``target``."""
    group, world, rank = state._group, state._world_size, state._rank
    shared = state.aggregation == "allreduce"
    positions = select(state.method, p, units, state.density, state.seed, step, SHARED if shared else rank)
    values = _sent_values(state, p, velocity, positions)
    wire = values.to(target.dtype)
    if state.error_feedback:
        if wire.dtype == torch.float32:
            p.index_fill_(0, positions, 0.0)
        else:  # what rounding to the wire dtype lost stays in the residual
            p.index_put_((positions,), values - wire.float())
    wire.div_(world)  # divide before the collective, as PyTorch's allreduce_hook does
    k = positions.numel()
    sent = k * wire.element_size()

    if shared:
        state._stats.add(k, sent, target.numel(), target.numel() * target.element_size())

        def write_shared(fut):
            target.zero_()
            target.index_copy_(0, positions, fut.value())
            return target

        return allreduce_sum(wire, group, world).then(write_shared)

    if state.method == "topk":
        index_dtype = torch.int32 if target.numel() < 2**31 else torch.int64
        payload = torch.cat([wire.view(torch.uint8), positions.to(index_dtype).view(torch.uint8)])
        sent += k * torch.empty((), dtype=index_dtype).element_size()
    else:  # random positions are recomputed from (seed, step, unit, rank): values only
        payload = wire
    state._stats.add(k, sent, target.numel(), target.numel() * target.element_size())

    def write_gathered(fut):
        rows = fut.value()
        if state.method == "topk":
            value_bytes = k * wire.element_size()
            parts = [(row[value_bytes:].view(index_dtype).long(), row[:value_bytes].view(wire.dtype)) for row in rows]
        else:
            parts = [
                (positions if r == rank else select(state.method, p, units, state.density, state.seed, step, r), rows[r])
                for r in range(world)
            ]
        accumulator = target if target.dtype == torch.float32 else torch.zeros(target.numel(), device=target.device)
        accumulator.zero_()
        # One index_add_ per rank, in rank order: positions within a rank are
        # distinct, so every rank sums in the same order and replicas stay
        # bitwise equal (a single index_add_ with repeats is nondeterministic
        # on CUDA).
        for where, vals in parts:
            accumulator.index_add_(0, where, vals.to(accumulator.dtype))
        if accumulator is not target:
            target.copy_(accumulator)
        return target

    return allgather(payload, group, world).then(write_gathered)


def _global_exchange(state: SparsifyState, step: int):
    """At the last bucket: select over all buckets of the step with one budget."""
    entries = state._pending_global
    state._pending_global = []
    sizes = [buffer.numel() for _, buffer, _, _ in entries]
    dtypes = {buffer.dtype for _, buffer, _, _ in entries}
    joined = torch.cat([p for _, _, p, _ in entries])
    target = torch.empty(joined.numel(), dtype=dtypes.pop() if len(dtypes) == 1 else torch.float32,
                         device=joined.device)
    velocities = [state.velocities.flat(index) for index, _, _, _ in entries] if state.momentum > 0.0 else []
    joined_velocity = torch.cat(velocities) if velocities else None
    fut = _exchange(state, joined, [Unit(0, 0, joined.numel())], target, step, joined_velocity)
    for velocity, chunk in zip(velocities, joined_velocity.split(sizes) if velocities else ()):
        velocity.copy_(chunk)
    if state.error_feedback:  # the residual update happened in `joined`: copy it back
        for (_, _, p, _), chunk in zip(entries, joined.split(sizes)):
            p.copy_(chunk)

    def finish(f):
        try:
            for (_, buffer, _, _), chunk in zip(entries, f.value().split(sizes)):
                buffer.copy_(chunk)
        except Exception as exc:
            for _, _, _, pending in entries[:-1]:
                pending.set_exception(exc)
            raise
        for _, buffer, _, pending in entries[:-1]:
            pending.set_result(buffer)
        return entries[-1][1]

    return fut.then(finish)


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
        A future holding ``bucket.buffer()``, overwritten with the average over
        ranks of each rank's sparsified compensated gradient.
    """
    state._bind(bucket)
    buffer = bucket.buffer()
    last = bucket.is_last()
    if bucket.index() == 0 and state._pending_global:
        state._pending_global = []  # left over from a backward that raised
    # Parameter keys are assigned at the very first call, warm-up included, so
    # that a resumed run (which starts on DDP's initial buckets) numbers the
    # parameters exactly as the uninterrupted run did.
    layout = state._layout(bucket)
    if state.step < state.warmup_steps:
        n = buffer.numel()
        state._stats.add(n, n * buffer.element_size(), n, n * buffer.element_size())
        if state.momentum > 0.0 or state.weight_decay > 0.0:
            _dense_warmup_term(state, bucket, layout)
        fut = allreduce_mean(buffer, state._group, state._world_size)
        if last:
            state._end_step(bucket.index(), compressed=False)
        return fut
    step = state.step
    p = _compensated(state, bucket, layout)
    velocity = _bucket_velocity(state, bucket, layout) if state.momentum > 0.0 else None
    if state.scope == "global":
        pending: torch.futures.Future = torch.futures.Future()
        state._pending_global.append((bucket.index(), buffer, p, pending))
        if not last:
            return pending
        fut = _global_exchange(state, step)
    else:
        if state.scope == "layer":
            units: List[Unit] = [Unit(key, offset, n) for key, offset, n in layout]
        else:
            units = [Unit(bucket.index(), 0, buffer.numel())]
        fut = _exchange(state, p, units, buffer, step, velocity)
    if last:
        state._end_step(bucket.index(), compressed=True)
    return fut

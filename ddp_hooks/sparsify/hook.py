r"""The sparsifying DDP communication hook: the DDP carrier of :class:`~.compressor.SparseCompressor`.

Per rank, per step, each bucket DDP hands over goes through the compressor
(compensate, select, pack, communicate; then unpack, fold and write: its
module docstring gives the maths, after Eghlidi & Jaggi 2020, arXiv 2009.09271)
with a budget per unit of selection (a layer, the bucket, or all buckets:
:class:`~ddp_hooks.SparsifyState`'s ``scope``). What this carrier adds, and
only it knows, is DDP's:

* **Buckets and parameters.** A bucket's layout, ``(key, offset, numel)``
  per parameter, keys the compressor's memory by parameter
  (:class:`~.memory.BucketLayouts`), so residuals follow their parameters
  when DDP rebuilds its buckets.
* **One verdict per step.** Each bucket is scanned once for a mark per
  parameter (:func:`scan`): 0 where DDP zero-filled an unused parameter (its
  residual is held, not sent), NaN where the gradient holds inf or NaN
  (every rank then receives NaN, so every rank discards the step alike), 1
  otherwise. Each bucket's exchange starts at once, but the states are
  folded and the results written only at the last bucket, once every
  exchange of the step has arrived and whether any carried a non-finite
  value is known: a discarded step writes NaN (``GradScaler`` skips it on
  every rank) and leaves every residual as it was.
* **The loss scale.** With ``SparsifyState(grad_scaler=scaler)`` the states
  are kept unscaled (``S`` read from the scaler at the first bucket, as a
  tensor): ``p = g + S e``, ``e <- e + g / S``.
* **The optimizer's momentum counted in sends** (``optimizer_momentum=
  "sends"``, the default with error feedback): the velocity steps with each
  parameter's momentum ``m`` read from its ``torch.optim.SGD``
  (:mod:`.momenta`), and the result is ``u_t - m u_{t-1}``
  (:func:`present_update`), so that SGD's own buffer holds ``u_t``.
* **Warm-up.** Plain allreduce for ``warmup_steps`` (every position through
  the compressor where the hook runs momentum or weight decay of its own),
  then the density falls from 1 to ``density`` over ``density_warmup_steps``.

**Futures.** Every future the hook returns is chained by ``then()``: on the
step's completion future, which is made with the bucket's device and set at
the end of the step's commit (recording an event on the commit's stream, for
which DDP's ``wait()`` makes its stream wait); in a plain-allreduce warm-up
step, on the collective's own future. The commit reads each exchange through
``wait()`` on the collective's own future.

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

from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .._internal.validation import check_hook_call
from . import checkpoint
from .compressor import PendingExchange, host_reads_free, units_of
from .memory import GLOBAL_BUCKET, Layout, SparseOutput, gather, owners
from .nodes import NodeShard, agree_in_node
from .momenta import refresh_momenta, velocity_momentum
from .selectors.draws import first_draws
from .state import SparsifyState

__all__ = ["sparsify_hook", "StepRun", "scan", "present_update"]

# What the carrier keeps of one bucket's exchange until the end of the step, a plain tuple (no record of its
# own on the bucket's path): the exchange; where its update is remembered for the optimizer's momentum
# (bucket index, layout, starts, momentum), or None; the result vector that receives the average instead of
# the bucket, or None; with scope="global", the buckets that receive the joined average's chunks, or None.
BucketExchange = Tuple[PendingExchange, Optional[tuple], Optional[SparseOutput], Optional[List[torch.Tensor]]]


class StepRun:
    """One backward pass: exchanges selected or sent, buckets waiting for the last, the loss scale, completion."""

    __slots__ = ("started", "sent", "waiting", "in_node", "scattered", "scale", "done")

    def __init__(self, scale: Optional[torch.Tensor], device: torch.device) -> None:
        self.started: List[BucketExchange] = []  # selected, in bucket order; sent by the hook a bucket later at most
        self.sent: List[BucketExchange] = []  # their collectives launched, in launch order
        self.waiting: list = []  # scope="global": (buffer, layout, starts, marks, decay) of each bucket so far
        self.in_node: List[NodeShard] = []  # with nodes: each bucket's shard, in bucket order
        self.scattered = 0  # with nodes: how many of them have arrived and begun their exchange
        self.scale = scale  # the loss scale S as a 0-dim tensor, or None without a grad scaler
        # set once the step is committed; with the device, so that setting it records an event on the stream
        self.done = torch.futures.Future(devices=None if device.type == "cpu" else [device])

    @property
    def busy(self) -> bool:
        """True while some exchange (started or sent) or waiting bucket has not been committed."""
        return bool(self.started or self.sent or self.waiting or self.in_node)


# No `from __future__ import annotations` in this module: DDP's register_comm_hook
# compares the hook's annotations with dist.GradBucket and Future[Tensor] objects.
def sparsify_hook(state: SparsifyState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Sparsify a DDP gradient bucket with error feedback and average it across ranks.

    Register with ``ddp_model.register_comm_hook(state, sparsify_hook)``; see
    the module docstring for what it does and :class:`SparsifyState` for the
    options.

    Returns:
        A future holding the average over ranks of each rank's sparsified
        compensated gradient: written into ``bucket.buffer()``, or, for
        float32 buckets on the CPU without ``gradient_as_bucket_view``, into
        a vector of the state kept at zero between steps
        (:class:`~.memory.SparseOutputs`), which DDP copies into ``.grad``
        alike. It completes when the step's last bucket has been committed.
    """
    if not isinstance(state, SparsifyState) or state.binding is None:  # the first call: check and bind
        check_hook_call("sparsify_hook", state, SparsifyState, bucket)
        state.bind(bucket)
    index, buffer, last = bucket.index(), bucket.buffer(), bucket.is_last()
    run = _begin_step(state, buffer.device) if index == 0 else state.run  # DDP hands buckets over in order
    # Parameter keys are assigned at the very first call, warm-up included, so that a resumed run (which
    # starts on DDP's initial buckets) numbers the parameters exactly as the uninterrupted run did.
    layout, starts = state.layouts.of_ddp_bucket(bucket)
    options, nodes = state.options, state.binding.nodes
    dense = state.step < options.warmup_steps
    if dense and nodes is None and options.momentum == 0.0 and options.weight_decay == 0.0:
        return _allreduce_bucket(state, buffer, last, index)
    gradients = bucket.gradients()  # views of the buffer, one per parameter
    decay = _decay(options.weight_decay, bucket.parameters(), layout, buffer)
    result = buffer
    if nodes is None:
        result_vector = None
        if options.scope != "global" and not dense:  # where it pays, the average goes to a vector kept at zero
            result_vector = state.results.for_bucket(index, buffer, gradients, bucket.parameters())
            result = buffer if result_vector is None else result_vector.tensor
        _start_exchange(state, run, index, buffer, layout, starts, scan(buffer, gradients, starts), decay,
                        dense=dense, last=last, result_vector=result_vector)
    else:  # dense inside the node: this rank's shard of the node's mean, exchanged once it has arrived
        sharding = state.shardings.of(index, layout, buffer, nodes)
        state.counters.add(0, 0, buffer.numel() - sharding.numel, (buffer.numel() - sharding.numel) *
                           buffer.element_size())  # (the compressor counts the shard; dense is the whole bucket)
        run.in_node.append(NodeShard(index, buffer, sharding, decay, nodes))
        ready = run.in_node[run.scattered:] if last else run.in_node[run.scattered:-1]  # the last bucket, or
        for node_shard in ready:  # the one before: its reduce-scatter ran while this bucket's gradient formed
            shard, sharding = node_shard.arrived(), node_shard.sharding
            _start_exchange(state, run, node_shard.index, shard, sharding.layout, sharding.starts,
                            scan(shard, sharding.pieces(shard), sharding.starts), node_shard.decay,
                            dense=dense, last=last and node_shard is run.in_node[-1], result_vector=None)
        run.scattered += len(ready)
    if last:
        _end_step(state, index, compressed=not dense)
        _commit_when_arrived(state, run, result)
    return _after_commit(run, result)


def _start_exchange(state: SparsifyState, run: StepRun, key: int, grad: torch.Tensor, layout: Layout,
                    starts: torch.Tensor, marks: torch.Tensor, decay: Optional[torch.Tensor], *, dense: bool,
                    last: bool, result_vector: Optional[SparseOutput]) -> None:
    """Begin one bucket's exchange (or its shard's) and send what has started, in bucket order on every rank.

    With ``scope="global"`` the buckets wait for the last, and go as one.
    """
    options, compressor, nodes = state.options, state.compressor, state.binding.nodes
    global_buffers = None
    if options.scope == "global" and not dense:  # all buckets in one exchange, at the last
        run.waiting.append((grad, layout, starts, marks, decay))
        if not last:
            return
        grad, layout, starts, marks, decay, global_buffers = _join(run)
        key = GLOBAL_BUCKET
    momentum = velocity_momentum(options, state.momenta, layout, grad.device)
    pending = compressor.begin(grad, units_of(layout, options.scope, key, grad.numel()), starts, marks, key=key,
                               layout=layout, group=state.binding.group if nodes is None else nodes.inter,
                               step=state.step, density=options.density_at(state.step), scale=run.scale,
                               decay=decay, momentum=momentum, everything=dense)
    run.started.append((pending, _update_record(state, key, layout, starts, momentum, dense), result_vector,
                        global_buffers))
    # Send what has started, in bucket order on every rank; a selection still waiting for its selector's
    # collectives waits until the next bucket has started its own (or until the last bucket).
    ready = run.started if last or not pending.choice.waits else run.started[:-1]
    for exchange in ready:
        compressor.send(exchange[0])
    run.sent.extend(ready)
    run.started = run.started[len(ready):]


def _begin_step(state: SparsifyState, device: torch.device) -> StepRun:
    """At the first bucket of a backward: a new run (dropping a backward that raised); the momenta, the scale."""
    if state.momenta.watching and state.options.counts_momentum_in_sends:
        refresh_momenta(state)
    scaler = state.grad_scaler
    # GradScaler.scale(t) is t * S on t's device: S as a tensor, without a host sync.
    scale = None if scaler is None else scaler.scale(torch.ones((), dtype=torch.float32, device=device))
    state.run = StepRun(scale, device)
    return state.run


def _end_step(state: SparsifyState, last_index: int, compressed: bool) -> None:
    """At the last bucket: advance the step; forget buckets past the last; check a loaded state's keys once."""
    state.step += 1
    state.counters.steps += 1
    state.counters.compressed_steps += int(compressed)
    compressor = state.compressor
    for store in (compressor.residuals, compressor.velocities, state.last_updates, state.results, state.layouts):
        store.drop_buckets_after(last_index)
    if state.binding.nodes is not None:
        state.shardings.drop_buckets_after(last_index)
    if state.loaded is not None and state.loaded.keys is not None:  # (after a load only: the steady state skips it)
        checkpoint.check_loaded_keys(state, compressed)


def _after_commit(run: StepRun, result: torch.Tensor) -> torch.futures.Future:
    """A bucket's future: ``result`` once the step is committed, or the step's error."""
    def result_after_commit(committed):
        committed.value()  # raises the step's error, so DDP sees a failed future, not a value
        return result

    return run.done.then(result_after_commit)


def _commit_when_arrived(state: SparsifyState, run: StepRun, last_result: torch.Tensor) -> None:
    """At the last bucket: wait for every exchange of the step, one verdict, fold and write each; complete the step.

    Here, on the backward pass's own thread and stream, not in a callback on
    a backend's thread: DDP waits for every bucket's future right after the
    last bucket in any case, and nothing of the hook then runs on a thread
    that a process group's teardown could find busy. The commit reads each
    exchange through ``wait()`` on the collective's own future
    (:meth:`~.compressor.SparseCompressor.unpack`), which on a GPU makes this
    stream wait for the collective's and does not block the host; the step's
    future, made with the device, records this stream's event when it is
    set, and every bucket's future is chained on it.
    """
    exchanges, run.sent = run.sent, []
    in_node, run.in_node = run.in_node, []
    try:
        _commit(state, exchanges, run.scale, in_node)
    except Exception as exc:  # a failed collective (a rank died, a timeout) fails every bucket's future
        run.done.set_exception(exc)
        raise
    run.done.set_result(last_result)


def _commit(state: SparsifyState, exchanges: Sequence[BucketExchange], scale: Optional[torch.Tensor],
            in_node: Sequence[NodeShard] = ()) -> None:
    """Apply the step's arrived exchanges: the same verdict on every rank (all saw the same data).

    With nodes, the exchanges hold this rank's shards, gathered into the buckets at the end.
    """
    compressor, nodes = state.compressor, state.binding.nodes
    arrived = [compressor.unpack(pending) for pending, *_ in exchanges]
    discard = torch.stack([bad for bad, _ in arrived]).any()
    if nodes is not None:  # a non-finite gradient reaches the ranks of one shard: the node agrees
        discard = agree_in_node(discard, nodes)
    state.nonfinite.add(discard)
    inv_scale = None if scale is None else scale.reciprocal()
    # The last update is remembered only from steps the optimizer takes: the verdict read on the host where
    # that is free; elsewhere a discarded step's update is remembered as zero (present_update's `discard`).
    applied, forgotten_if = True, discard
    if host_reads_free(discard.device):
        forgotten_if = None
        applied = not any(update is not None for _, update, _, _ in exchanges) or not bool(discard)
    written_by_bucket = []  # with nodes: the positions each bucket's shard holds values at
    for (pending, update, result_vector, global_buffers), (_, parts) in zip(exchanges, arrived):
        target = None  # the gradient itself, zeroed once folded, or the vector kept at zero
        if result_vector is not None:
            target = result_vector.overwrite() if pending.dense else result_vector.clear()
        written = compressor.finish(pending, parts, discard=discard, target=target, inv_scale=inv_scale)
        target = pending.grad if result_vector is None else result_vector.tensor
        if update is not None and applied:
            written = present_update(state.last_updates, update, target, written, scale, inv_scale,
                                     whole=pending.dense, discard=forgotten_if)
        if result_vector is not None:
            result_vector.written = written
        if nodes is not None:
            # the node gathers the written entries where every rank holds as many: each piece has its own budget
            # (layer scope), or nothing but this step's (the last update's entries are a bucket's whole budget's,
            # which a data-dependent selector splits over the parameters differently on each rank)
            sparse_gather = not pending.dense and (update is None or state.options.scope == "layer")
            written_by_bucket.append(written if sparse_gather else None)
        if global_buffers is not None:
            for buffer, chunk in zip(global_buffers, pending.grad.split([b.numel() for b in global_buffers])):
                buffer.copy_(chunk)
    if len(written_by_bucket) != len(in_node):  # (scope="global": one exchange for every bucket's shard)
        written_by_bucket = [None] * len(in_node)
    for node_shard, written in zip(in_node, written_by_bucket):
        node_shard.start_gather(nodes, written)
    for node_shard in in_node:
        node_shard.spread()


def _allreduce_bucket(state: SparsifyState, buffer: torch.Tensor, last: bool, index: int) -> torch.futures.Future:
    """A warm-up step without momentum or weight decay in the hook: the plain average, as PyTorch's allreduce_hook."""
    n = buffer.numel()
    state.counters.add(n, n * buffer.element_size(), n, n * buffer.element_size())
    buffer.div_(state.binding.world_size)  # divide before the collective, so half sums cannot overflow
    fut = dist.all_reduce(buffer, group=state.binding.group, async_op=True).get_future()
    if last:
        _end_step(state, index, compressed=False)
    return fut.then(lambda arrived: arrived.value()[0])


def _update_record(state: SparsifyState, key: int, layout: Layout, starts: torch.Tensor, momentum,
                   dense: bool) -> Optional[tuple]:
    """Where an exchange's averaged update is remembered, with the momentum that multiplies it next; or None."""
    if not state.options.counts_momentum_in_sends or dense:
        return None
    return key, layout, starts, 0.0 if momentum is None else momentum


def _join(run: StepRun):
    """The waiting buckets laid end to end: one flat gradient, its layout, starts, marks, decay, and the buckets."""
    buffers, layouts, bucket_starts, bucket_marks, decays = zip(*run.waiting)
    run.waiting = []
    layout, starts, shift = [], [], 0
    for buffer, bucket_layout, starts_of_bucket in zip(buffers, layouts, bucket_starts):
        layout.extend((key, offset + shift, n) for key, offset, n in bucket_layout)
        starts.append(starts_of_bucket + shift)
        shift += buffer.numel()
    decay = None if decays[0] is None else torch.cat(decays)
    return torch.cat(buffers), tuple(layout), torch.cat(starts), torch.cat(bucket_marks), decay, list(buffers)


def _decay(weight_decay: float, params: Sequence[torch.Tensor], layout: Layout,
           buffer: torch.Tensor) -> Optional[torch.Tensor]:
    """``weight_decay * x`` laid out like the bucket, in float32, or None without weight decay in the hook."""
    if weight_decay == 0.0:
        return None
    decay = torch.empty(buffer.numel(), dtype=torch.float32, device=buffer.device)
    for param, (_, offset, n) in zip(params, layout):
        torch.mul(param.detach().reshape(-1), weight_decay, out=decay[offset:offset + n])
    return decay


def present_update(store, update: tuple, target: torch.Tensor, written: List[torch.Tensor],
                   scale: Optional[torch.Tensor], inv_scale: Optional[torch.Tensor], whole: bool = False,
                   discard: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
    """Turn the averaged update ``u_t`` in ``target`` into ``u_t - m u_{t-1}``; remember ``u_t`` in ``store``.

    The optimizer's buffer then steps to ``m (u_{t-1} + z) + u_t - m u_{t-1}
    = u_t + m z``: it holds this step's sent velocity (plus the momentum of
    whatever else it was given, weight decay), whatever it held from the
    sends before. ``update`` is ``(bucket, layout, starts, momentum)``.
    Returns every position now written in ``target``. Under AllGather the
    ranks' positions overlap: a position's first entry keeps its value, the
    others 0 (no count read on the host). Where the host does not read the
    verdict, the step is remembered as zero if ``discard`` (a 0-dim bool) is set.
    """
    bucket, layout, starts, m = update
    whole = whole and len(written) == 1
    positions = written[0] if len(written) == 1 else torch.cat(written)
    values = gather(target, positions, whole).float()
    if values is target:  # sent whole: a copy, as target changes below
        values = values.clone()
    if len(written) > 1:
        values = torch.where(first_draws(positions, target.numel()), values, 0.0)
    previous = store.get(bucket, layout, target.device)
    if previous is not None and (isinstance(m, torch.Tensor) or m != 0.0):
        where, before, was_whole = previous
        if isinstance(m, torch.Tensor):
            factor = m.index_select(0, owners(starts, where, target.numel(), was_whole)).neg_()
        else:
            factor = torch.full((), -float(m), device=target.device)
        if scale is not None:
            factor = factor * scale
        change = (before * factor).to(target.dtype)  # (-0.0 where an entry holds 0: adding it changes nothing)
        if was_whole:
            target.add_(change)
        else:
            target.index_add_(0, where, change)
        written = [positions, where]
    remembered = values if inv_scale is None else values * inv_scale
    if discard is not None:
        remembered = remembered.masked_fill(discard, 0.0)
    store.put(bucket, layout, positions, remembered, whole)
    return written


def scan(buffer: torch.Tensor, gradients: Sequence[torch.Tensor], starts: torch.Tensor) -> torch.Tensor:
    """Per parameter, a float32 mark of its gradient: 0 if all zero, NaN if it holds inf/NaN, else 1.

    ``buffer`` is the flat bucket, ``gradients`` its per-parameter views,
    ``starts`` their offsets (on the buffer's device). Where the host may
    read (:func:`~.compressor.host_reads_free`), for float32 and float64, one
    read pass over the bucket: ``sum(buffer)`` is finite iff every entry is
    (a sum that overflows is measured again per parameter), and a parameter
    whose first entry is non-zero has a gradient; the rare parameter whose
    first entry is zero is looked at in 8 more entries spread over it, and
    read whole only if they are all zero. Elsewhere a parameter's mark comes
    from its ``max |g|`` (``aminmax``), with no host sync.

    Example::

        >>> g = torch.tensor([0.0, 0.0, 1.0, 2.0, float("inf"), 3.0])
        >>> scan(g, list(g.split([2, 2, 2])), torch.tensor([0, 2, 4])).tolist()
        [0.0, 1.0, nan]
    """
    if not gradients:
        return torch.zeros(0)
    if (not host_reads_free(buffer.device) or buffer.dtype not in (torch.float32, torch.float64)
            or not buffer.numel() or not torch.isfinite(buffer.sum())):  # (an inf or NaN, or a sum that overflowed)
        return _marks(torch.stack([_max_magnitude(g) for g in gradients]))
    firsts = buffer.index_select(0, starts.clamp(max=buffer.numel() - 1))
    marks = (firsts != 0).float()
    for i, g in enumerate(gradients):
        if not g.numel():  # its start is the next parameter's (or past the end)
            marks[i] = 0.0
    zero_first = [i for i in torch.nonzero(marks == 0).squeeze(1).tolist() if gradients[i].numel()]
    if zero_first:  # rare: look at 8 more entries of each, then read whole those where all are zero
        base, spread = buffer.storage_offset(), []
        for i in zero_first:
            g = gradients[i]
            spread += [g.storage_offset() - base + int(f * g.numel()) for f in _SPREAD]
        seen = buffer.index_select(0, torch.tensor(spread, dtype=torch.int64)).view(len(zero_first), -1).any(1)
        marks.index_copy_(0, torch.tensor(zero_first, dtype=torch.int64), seen.float())
        for i, found in zip(zero_first, seen.tolist()):
            if not found:
                marks[i] = float(bool(gradients[i].any()))
    return marks


# Golden-ratio fractions of a parameter's length, 0.618, 0.236, 0.854, ...: where a parameter whose first entry
# is zero is looked at before it is read whole. Halves and quarters would fall in the first column of a weight
# matrix, which a dead input feature (a border pixel after ReLU and pooling, a token not in the batch) keeps at
# zero at every step.
_SPREAD = [(j * 0.6180339887498949) % 1.0 for j in range(1, 9)]


def _marks(magnitudes: torch.Tensor) -> torch.Tensor:
    """Per-parameter ``max |g|`` (any dtype) as marks: 0 stays 0, inf/NaN becomes NaN, anything else 1."""
    return (magnitudes != 0).float().masked_fill_(~torch.isfinite(magnitudes), float("nan"))


def _max_magnitude(g: torch.Tensor) -> torch.Tensor:
    if not g.numel():
        return g.new_zeros(())
    low, high = torch.aminmax(g)
    return torch.maximum(low.abs(), high.abs())

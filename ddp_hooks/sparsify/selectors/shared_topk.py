r"""Shared top-k: one leader rank's top-k positions, used by every rank, so values are summed by AllReduce.

Plain top-k lets each rank choose its own positions, so each must send them
with its values and the exchange is an AllGather: every rank receives
``(W - 1) k`` values and positions, growing with the number of ranks ``W``.
ScaleCom (Chen et al., NeurIPS 2020, "Scalable Sparsified Gradient
Compression") has one worker per step, cycling through the workers, choose
its local top-k positions for everybody; every worker then sends its own
values at those positions, and values at shared positions sum by AllReduce.

Per unit ``u`` (a layer, a bucket, or all buckets) and step ``t``:

1. **Leader.** ``leader = (t + key_u) mod W`` (:func:`leaders`): it rotates
   with the step and, in layer scope, across the units of a step, so each
   rank selects for ``1 / W`` of the units on average over ``W`` steps.
   Units of fewer than ``SPREAD_FROM`` entries (2^16) all follow key 0
   instead: their selection costs less than the wait for one more leader's
   broadcast, so the small layers of a step share one leader.
2. **Select.** The leader takes the top ``k_u`` of ``|p|``, its own
   error-corrected gradient ``p = g + e`` (exact, as :mod:`.topk`).
3. **Share.** Every rank receives the leaders' positions: one
   ``broadcast`` from each rank that leads some unit of the request, of
   exactly the positions it chose, relative to their unit: int16 when no
   unit has more than ``2^16`` entries (stored less ``2^15``), else int32.
   Positions thus travel once per unit, from its leader, instead of from
   every rank with its values. (One padded ``all_gather`` of all the
   leaders' rows instead sent more bytes on the simulated cluster at about
   the same step time: gloo's all_gather costs more per call than a
   broadcast, and the padding travels.)

The exchange then sends each rank's ``p`` at those positions and sums them
by AllReduce; error feedback keeps the rest, as for every selector, so every
gradient reaches the model exactly once. A rank's large entries wait for its
own turn as leader at most ``W - 1`` steps, unless another leader picks them
first. The broadcasts are left in flight (:meth:`SharedTopK.begin`): the
hook waits for a bucket's positions only at its next bucket, so a rank
goes on with its backward pass while its leaders catch up.

Example (one process: the rank leads every unit)::

    >>> import torch
    >>> from ddp_hooks.sparsify.selectors import SelectionRequest, Unit
    >>> p = torch.tensor([0.5, -4.0, 1.0, 3.0, 0.0, -2.0])
    >>> request = SelectionRequest(units=(Unit(0, 0, 3), Unit(1, 3, 3)), density=0.34, seed=0, step=0,
    ...                            magnitude=p.abs())
    >>> sorted(SharedTopK().select(request).tolist())
    [1, 2, 3, 5]
"""

from __future__ import annotations

from typing import List, Tuple

import torch
import torch.distributed as dist

from .base import Choice, SelectionRequest, Selector
from .topk import topk_units, unit_tensors

__all__ = ["SharedTopK", "leaders", "SPREAD_FROM"]

#: Units of at least this many entries get a leader of their own key; smaller ones share key 0's. Measured
#: on the simulated cluster (bench/README.md, "Shared top-k against top-k"): on ResNet-20, whose layers are all
#: smaller, one leader per step instead of one per layer; ResNet-18's large layers still rotate.
SPREAD_FROM = 1 << 16


def leaders(keys, sizes, step: int, world_size: int) -> List[int]:
    """The leader rank of each unit at ``step``: ``(step + key) mod world_size``, key 0 for small units.

    A function of the unit's own key and size, not of the other units of
    its bucket, so DDP's bucket rebuild (and a resume on its initial
    buckets) cannot change who leads; over ``W`` consecutive steps every
    rank leads every unit once, so each rank does ``1 / W`` of top-k's
    selection on average. Units under :data:`SPREAD_FROM` entries lead as
    key 0: in a step they share one leader, one broadcast fewer to wait for
    per further leader, for a selection that costs little.
    """
    return [(step + (key if numel >= SPREAD_FROM else 0)) % world_size for key, numel in zip(keys, sizes)]


class SharedTopK(Selector):
    """The top-k positions of one leader rank per unit, rotating, shared by all: values summed by AllReduce."""

    name = "shared_topk"
    code = 3
    aggregations = ("allreduce",)
    aggregation_reason = ("every rank sends at its unit's leader's positions, which are shared, so the values "
                          "are summed by AllReduce; AllGather would only send them W - 1 more times")
    reads_values = True
    communicates = True

    def choose(self, request: SelectionRequest, ks: Tuple[int, ...]) -> torch.Tensor:
        return self.begin(request, ks).wait()

    def begin(self, request: SelectionRequest, ks: Tuple[int, ...]) -> Choice:
        """Select the units this rank leads and start the leaders' broadcasts; ``wait()`` lays the positions out."""
        units, world = request.units, request.world_size
        rank, lead = _rank_and_leaders(request)
        mine = [i for i, leader in enumerate(lead) if leader == rank]
        my_units, my_ks = tuple(units[i] for i in mine), tuple(ks[i] for i in mine)
        chosen = self._top_k(request, my_units, my_ks)
        if world == 1:
            return Choice.ready(chosen)
        dtype, shift = _position_code(units)
        rows, works = {}, []  # each leading rank's positions, relative to their unit, less the shift
        for r in sorted(set(lead)):  # one broadcast per leading rank, in rank order on every rank
            if r == rank:
                row = (chosen - _unit_starts(my_units, my_ks, request.where) - shift).to(dtype)
            else:
                row = torch.empty(sum(k for k, leader in zip(ks, lead) if leader == r), dtype=dtype,
                                  device=request.where)
            # as bytes: a broadcast only moves them, and gloo refuses int16
            works.append(dist.broadcast(row.view(torch.uint8), dist.get_global_rank(request.group, r),
                                        group=request.group, async_op=True))
            rows[r] = row

        def positions() -> torch.Tensor:
            for work in works:
                work.wait()
            # back to unit order: unit i's positions are the next ks[i] of its leader's row
            taken = dict.fromkeys(rows, 0)
            parts = []
            for k, leader in zip(ks, lead):
                parts.append(rows[leader][taken[leader]:taken[leader] + k])
                taken[leader] += k
            relative = torch.cat(parts).long() + shift
            return relative + _unit_starts(tuple(units), tuple(ks), request.where)

        return Choice(positions)

    def selection_bytes(self, request: SelectionRequest, ks: Tuple[int, ...]) -> int:
        """This rank's share of the positions collectives: the positions it broadcasts as a leader."""
        if request.world_size == 1:
            return 0
        rank, lead = _rank_and_leaders(request)
        itemsize = torch.empty(0, dtype=_position_code(request.units)[0]).element_size()
        return sum(k for k, leader in zip(ks, lead) if leader == rank) * itemsize

    @staticmethod
    def _top_k(request: SelectionRequest, units, ks) -> torch.Tensor:
        """This rank's top-k of the units it leads (ascending, as in the request), concatenated."""
        if not units:
            return torch.zeros(0, dtype=torch.int64, device=request.where)
        return topk_units(request.magnitude, [u.offset for u in units], [u.numel for u in units], ks,
                          request.scratch_mask, request.reads_on_host)


def _position_code(units) -> Tuple[torch.dtype, int]:
    """The dtype of positions relative to their unit, and the shift subtracted to fit it (int16 holds 0..65535)."""
    largest = max(u.numel for u in units)
    if largest <= 2**16:
        return torch.int16, 2**15
    return (torch.int32 if largest <= 2**31 else torch.int64), 0


def _unit_starts(units, ks, device) -> torch.Tensor:
    """Each position's unit offset, for ``ks[i]`` positions of ``units[i]`` in turn (from tensors kept per layout)."""
    if not units:
        return torch.zeros(0, dtype=torch.int64, device=device)
    offsets, budgets = unit_tensors(tuple(u.offset for u in units), tuple(ks), device)
    return offsets.repeat_interleave(budgets, output_size=sum(ks))


def _rank_and_leaders(request: SelectionRequest) -> Tuple[int, List[int]]:
    """This rank in the request's group, and the leader of each of its units."""
    rank = dist.get_rank(request.group) if request.world_size > 1 else 0
    return rank, leaders([u.key for u in request.units], [u.numel for u in request.units], request.step,
                         request.world_size)

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
2. **Select.** The leader takes the top ``k_u`` of ``|p|``, its own
   error-corrected gradient ``p = g + e`` (exact, as :mod:`.topk`).
3. **Share.** Every rank receives the leaders' positions: one ``broadcast``
   from each rank that leads some unit of the request (int32 when the
   vector allows), of exactly the positions it chose. Positions thus travel
   once per unit, from its leader, instead of from every rank with its
   values.

The exchange then sends each rank's ``p`` at those positions and sums them
by AllReduce; error feedback keeps the rest, as for every selector, so every
gradient reaches the model exactly once. A rank's large entries wait for its
own turn as leader at most ``W - 1`` steps, unless another leader picks them
first. The positions collective runs inside the hook call (blocking, one
small collective per exchange).

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

from .base import SelectionRequest, Selector
from .topk import topk_units

__all__ = ["SharedTopK", "leaders"]


def leaders(keys, step: int, world_size: int) -> List[int]:
    """The leader rank of each unit key at ``step``: ``(step + key) mod world_size``.

    A function of the unit's own key, not of the other units of its bucket,
    so DDP's bucket rebuild (and a resume on its initial buckets) cannot
    change who leads; over ``W`` consecutive steps every rank leads every
    unit once, so each rank does ``1 / W`` of top-k's selection on average.
    """
    return [(step + key) % world_size for key in keys]


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
        units, world = request.units, request.world_size
        rank, lead = _rank_and_leaders(request)
        mine = [i for i, leader in enumerate(lead) if leader == rank]
        chosen = self._top_k(request, [units[i] for i in mine], [ks[i] for i in mine])
        if world == 1:
            return chosen
        index_dtype = torch.int32 if request.magnitude.numel() < 2**31 else torch.int64
        # one broadcast per leading rank, of exactly its positions, in rank order on every rank
        led = {r: sum(k for k, leader in zip(ks, lead) if leader == r) for r in sorted(set(lead))}
        rows = {}
        for r, count in led.items():
            row = chosen.to(index_dtype) if r == rank else torch.empty(count, dtype=index_dtype, device=request.where)
            dist.broadcast(row, dist.get_global_rank(request.group, r), group=request.group)
            rows[r] = row
        # back to unit order: unit i's positions are the next ks[i] of its leader's row
        taken = dict.fromkeys(led, 0)
        parts = []
        for k, leader in zip(ks, lead):
            parts.append(rows[leader][taken[leader]:taken[leader] + k])
            taken[leader] += k
        return torch.cat(parts).long()

    def selection_bytes(self, request: SelectionRequest, ks: Tuple[int, ...]) -> int:
        """This rank's share of the positions collectives: the positions it broadcasts as a leader."""
        world = request.world_size
        if world == 1:
            return 0
        itemsize = 4 if request.magnitude.numel() < 2**31 else 8
        rank, lead = _rank_and_leaders(request)
        return sum(k for k, leader in zip(ks, lead) if leader == rank) * itemsize

    @staticmethod
    def _top_k(request: SelectionRequest, units, ks) -> torch.Tensor:
        """This rank's top-k of the units it leads (ascending, as in the request), concatenated."""
        if not units:
            return torch.zeros(0, dtype=torch.int64, device=request.where)
        return topk_units(request.magnitude, [u.offset for u in units], [u.numel for u in units], ks,
                          request.scratch_mask)


def _rank_and_leaders(request: SelectionRequest) -> Tuple[int, List[int]]:
    """This rank in the request's group, and the leader of each of its units."""
    rank = dist.get_rank(request.group) if request.world_size > 1 else 0
    return rank, leaders([u.key for u in request.units], request.step, request.world_size)

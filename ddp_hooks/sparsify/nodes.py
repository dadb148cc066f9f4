r"""Nodes: dense inside a node, sparse between nodes.

The ``W = N L`` ranks are grouped into ``N`` nodes of ``L`` ranks each
(``SparsifyState(nodes=...)``). Each parameter of ``m`` entries is cut into
``L`` pieces of ``c = ceil(m / L)`` entries, the last ones padded with zeros;
local rank ``j`` of a node owns the ``j``-th piece of every parameter, its
*shard*. One bucket then takes three stages:

1. **scatter** inside the node (dense, on the fast link): a reduce-scatter
   gives local rank ``j`` its shard of the node's mean,
   :math:`s_j = \tfrac1L \sum_{r \in \text{node}} g^{(r)}_j`;
2. **between nodes** (sparse, on the slow link): :math:`s_j` goes through the
   compressor (:class:`~.compressor.SparseCompressor`, unchanged) over the
   ``N`` ranks of local rank ``j``, one per node, with this rank's residual on
   its shard: :math:`\hat s_j = \tfrac1N \sum_{\text{nodes}} C(s_j + e_j)`;
3. **gather** inside the node: an all-gather of the :math:`\hat s_j`, laid
   back out into the bucket: of the entries the exchange wrote (positions
   and values), where every rank of the node holds as many (its pieces have
   the same sizes and budgets) and that is fewer bytes, else of the shards.

So every rank receives the mean over all ``W`` ranks of what the nodes sent,
each rank sends ``density * n / L`` entries over the slow link (a flat
exchange sends ``density * n``), and keeps residuals of ``n / L`` entries.
Pieces are cut per parameter, not per bucket, so a rank's residuals stay
its own when DDP rebuilds its buckets.

Example (which ranks form the nodes; :func:`node_groups` makes their groups)::

    >>> node_ranks(2, world_size=4)
    [[0, 1], [2, 3]]
    >>> Sharding(((0, 0, 5), (1, 5, 2)), 7, size=2, device=torch.device("cpu")).layout
    ((0, 0, 3), (1, 3, 1))
"""

from __future__ import annotations

import os
import zlib
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Union

import torch
import torch.distributed as dist

from .memory import Layout

__all__ = ["Nodes", "NodeSpec", "check_node_spec", "node_ranks", "nodes_code", "node_groups", "Sharding",
           "Shardings", "NodeShard", "agree_in_node"]

#: What ``SparsifyState(nodes=...)`` takes: None (flat), "local" (``LOCAL_WORLD_SIZE`` ranks per node),
#: an int (ranks per node, consecutive), or the ranks of each node.
NodeSpec = Union[None, str, int, Sequence[Sequence[int]]]

_WHY = "the hierarchical exchange averages densely inside a node and sparsely between nodes"


class Nodes(NamedTuple):
    """This rank's place in the nodes, and the two groups it communicates in."""

    intra: Any  # the group of this rank's node (L ranks)
    inter: Any  # the group of the ranks with this local rank, one per node (N ranks)
    size: int  # L, ranks per node
    count: int  # N, nodes
    local_rank: int  # j, this rank's place in its node: it owns piece j of every parameter


def check_node_spec(nodes: NodeSpec) -> NodeSpec:
    """The ``nodes`` argument, checked without torch.distributed: None, "local", an int >= 1, or rank lists."""
    if nodes is None or nodes == "local":
        return nodes
    if isinstance(nodes, bool) or isinstance(nodes, str):
        raise ValueError(f"`nodes` must be None, 'local', an int (ranks per node) or a list of each node's ranks, "
                         f"got {nodes!r}; {_WHY}")
    if isinstance(nodes, int):
        if nodes < 1:
            raise ValueError(f"`nodes` as ranks per node must be >= 1, got {nodes}; {_WHY}")
        return nodes
    try:
        groups = [list(node) for node in nodes]
    except TypeError:
        raise TypeError(f"`nodes` must be None, 'local', an int or a list of each node's ranks, got {nodes!r} of "
                        f"type {type(nodes).__name__}; {_WHY}") from None
    if not all(isinstance(r, int) and not isinstance(r, bool) for node in groups for r in node):
        raise TypeError(f"`nodes` as each node's ranks must hold ints, got {nodes!r}; {_WHY}")
    sizes = {len(node) for node in groups}
    if not groups or len(sizes) != 1 or 0 in sizes:
        raise ValueError(f"`nodes` must list nodes of one size, at least one rank each, got sizes "
                         f"{[len(node) for node in groups]}; local rank j of every node exchanges shard j, "
                         "so every node holds the same number of ranks")
    flat = [r for node in groups for r in node]
    if len(set(flat)) != len(flat):
        raise ValueError(f"`nodes` names a rank twice: {groups}; each rank belongs to one node")
    return tuple(tuple(node) for node in groups)


def node_ranks(nodes: NodeSpec, world_size: int) -> List[List[int]]:
    """The ranks of each node, for a world of ``world_size`` ranks (``"local"`` reads ``LOCAL_WORLD_SIZE``)."""
    if nodes == "local":
        value = os.environ.get("LOCAL_WORLD_SIZE")
        if value is None:
            raise RuntimeError("SparsifyState(nodes='local') reads the ranks per node from LOCAL_WORLD_SIZE, which "
                               "is not set; run under torchrun, which sets it, or give nodes=<ranks per node>")
        nodes = int(value)
    if isinstance(nodes, int):
        if world_size % nodes:
            raise ValueError(f"`nodes`={nodes} ranks per node does not divide the world size {world_size}; "
                             "every node must hold the same number of ranks")
        return [list(range(start, start + nodes)) for start in range(0, world_size, nodes)]
    groups = [list(node) for node in nodes]
    if sorted(r for node in groups for r in node) != list(range(world_size)):
        raise ValueError(f"`nodes`={groups} must name every rank of the world size {world_size} exactly once")
    return groups


def nodes_code(ranks: List[List[int]]) -> int:
    """A number that differs between two groupings of the ranks into nodes (for the cross-rank check).

    >>> nodes_code([[0, 1], [2, 3]]) != nodes_code([[0, 2], [1, 3]])
    True
    """
    return zlib.crc32(repr([list(node) for node in ranks]).encode())


def node_groups(nodes: NodeSpec, group) -> Nodes:
    """Make the node's group and the cross-node group of this rank; every rank calls it, in the same order.

    ``group`` must be the default group: the nodes name its ranks.
    """
    if group is not dist.group.WORLD:
        raise ValueError(f"SparsifyState(nodes=...) needs the default process group (process_group=None), got "
                         f"{group!r}: the nodes name global ranks, and their groups are made from the default group")
    world, rank = dist.get_world_size(), dist.get_rank()
    ranks = node_ranks(nodes, world)
    intra = inter = None
    for node in ranks:  # (new_group is collective: every rank makes every group, in this order)
        made = dist.new_group(node)
        if rank in node:
            intra, local_rank = made, node.index(rank)
    for j in range(len(ranks[0])):
        made = dist.new_group([node[j] for node in ranks])
        if j == local_rank:
            inter = made
    return Nodes(intra=intra, inter=inter, size=len(ranks[0]), count=len(ranks), local_rank=local_rank)


class Sharding:
    """How a bucket of this layout is cut into pieces: the shard's layout and where each bucket entry goes.

    ``destination[i]`` is bucket entry ``i``'s place in the padded vector,
    the ``L`` shards end to end (shard ``j`` at ``j * numel``).
    """

    __slots__ = ("layout", "starts", "numel", "destination", "padded", "gathered")

    def __init__(self, bucket_layout: Layout, bucket_numel: int, size: int, device: torch.device,
                 dtype: torch.dtype = torch.float32) -> None:
        pieces = [-(-n // size) for _, _, n in bucket_layout]  # c = ceil(m / L) per parameter
        shard_offsets, shard_numel = [], 0
        for c in pieces:
            shard_offsets.append(shard_numel)
            shard_numel += c
        self.layout: Layout = tuple((key, offset, c) for (key, _, _), offset, c in zip(bucket_layout, shard_offsets,
                                                                                       pieces))
        self.numel = shard_numel
        self.starts = torch.tensor(shard_offsets, dtype=torch.int64, device=device)
        destination, end = [], 0
        for (key, offset, n), shard_offset, c in zip(bucket_layout, shard_offsets, pieces):
            if offset != end:
                raise RuntimeError(f"the bucket's parameters are not laid out end to end (parameter #{key} at "
                                   f"offset {offset}): the hierarchical exchange cannot cut it into shards")
            entry = torch.arange(n, dtype=torch.int64)
            destination.append((entry // c) * shard_numel + shard_offset + entry % c if c else entry)
            end += n
        if end != bucket_numel:
            raise RuntimeError(f"the bucket holds {bucket_numel} entries but its parameters "
                               f"{sum(n for _, _, n in bucket_layout)}: it cannot be cut into shards")
        self.destination = torch.cat(destination).to(device) if destination else torch.zeros(0, dtype=torch.int64)
        # what the reduce-scatter reads (zero where no entry lands, for good) and what the all-gather writes
        self.padded = torch.zeros(size * shard_numel, dtype=dtype, device=device)
        self.gathered = torch.empty_like(self.padded)

    def pieces(self, shard: torch.Tensor) -> List[torch.Tensor]:
        """The shard's piece of each parameter, as views."""
        return list(shard.split([n for _, _, n in self.layout]))


class Shardings:
    """Each bucket index's :class:`Sharding`, remade when its layout changes (DDP rebuilt its buckets)."""

    def __init__(self) -> None:
        self._by_bucket: Dict[int, tuple] = {}

    def of(self, index: int, layout: Layout, buffer: torch.Tensor, nodes: Nodes) -> Sharding:
        kept = self._by_bucket.get(index)
        if kept is None or kept[0] != layout or kept[1].padded.dtype != buffer.dtype:
            kept = self._by_bucket[index] = (layout, Sharding(layout, buffer.numel(), nodes.size, buffer.device,
                                                              buffer.dtype))
        return kept[1]

    def drop_buckets_after(self, last_index: int) -> None:
        for index in [i for i in self._by_bucket if i > last_index]:
            del self._by_bucket[index]


class NodeShard:
    """One bucket inside its node: the reduce-scatter into this rank's shard, then the all-gather back."""

    __slots__ = ("index", "bucket", "sharding", "shard", "decay", "work", "entries")

    def __init__(self, index: int, bucket: torch.Tensor, sharding: Sharding, decay: Optional[torch.Tensor],
                 nodes: Nodes) -> None:
        """Start the reduce-scatter of ``bucket / L`` (``decay``, the hook's ``wd * x``, is cut alike)."""
        self.index, self.bucket, self.sharding = index, bucket, sharding
        self.entries: Optional[tuple] = None  # a sparse gather's (arrival, count), or None
        j, n = nodes.local_rank, sharding.numel
        padded = sharding.padded
        padded.index_copy_(0, sharding.destination, bucket)
        padded.div_(nodes.size)  # divide before the collective, so half sums cannot overflow
        self.shard = torch.empty(n, dtype=bucket.dtype, device=bucket.device)
        self.work = _reduce_scatter(self.shard, padded, nodes.intra)
        self.decay = None
        if decay is not None:  # the same on every rank: this rank's piece of it, no collective
            whole = torch.zeros(padded.numel(), dtype=decay.dtype, device=decay.device)
            self.decay = whole.index_copy_(0, sharding.destination, decay)[j * n:(j + 1) * n]

    def arrived(self) -> torch.Tensor:
        """This rank's shard of the node's mean, once the reduce-scatter has finished (``wait()``)."""
        self.work.wait()
        return self.shard

    def start_gather(self, nodes: Nodes, written: Optional[List[torch.Tensor]] = None) -> None:
        """All-gather every rank's result shard inside the node: only the entries at ``written`` (the
        positions the exchange wrote; the shard is zero elsewhere) where that moves fewer bytes, else whole."""
        shard, self.entries = self.shard, None
        count = 0 if written is None else sum(p.numel() for p in written)
        if written is None or count * (shard.element_size() + 4) >= shard.numel() * shard.element_size():
            self.work = _all_gather(self.sharding.gathered, shard, nodes.intra)
            return
        positions = written[0] if len(written) == 1 else torch.cat(written)
        payload = torch.cat([shard.index_select(0, positions).view(torch.uint8),
                             positions.to(torch.int32).view(torch.uint8)])  # (a shard is < 2**31 entries)
        arrival = torch.empty(nodes.size, payload.numel(), dtype=torch.uint8, device=shard.device)
        self.entries = (arrival, count)
        self.work = _all_gather(arrival.view(-1), payload, nodes.intra)

    def spread(self) -> torch.Tensor:
        """Once gathered, the node's result laid out back into the bucket."""
        self.work.wait()
        gathered, n = self.sharding.gathered, self.sharding.numel
        if self.entries is not None:  # each rank's values at its positions, into its shard's place
            arrival, count = self.entries
            value_bytes = count * self.shard.element_size()
            values = arrival[:, :value_bytes].reshape(-1).view(self.shard.dtype)
            # clone(): a row's position bytes need not start at a multiple of 4
            positions = arrival[:, value_bytes:].clone().view(torch.int32).long()
            positions += torch.arange(arrival.shape[0], device=positions.device).unsqueeze(1) * n
            gathered.zero_().scatter_(0, positions.reshape(-1), values)
        return torch.index_select(gathered, 0, self.sharding.destination, out=self.bucket)


def agree_in_node(discard: torch.Tensor, nodes: Nodes) -> torch.Tensor:
    """Whether any rank of the node discards the step (0-dim bool): a non-finite value reaches one shard only."""
    flag = discard.to(torch.float32).reshape(1)
    dist.all_reduce(flag, group=nodes.intra, async_op=True).wait()
    return (flag > 0).reshape(())


def _reduce_scatter(output: torch.Tensor, tensor: torch.Tensor, group):
    # torch >= 2.14 names it reduce_scatter_single; older releases reduce_scatter_tensor. Gloo's Work has no
    # future: the carrier waits on the Work itself (on a GPU that makes the current stream wait).
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, tensor, group=group, async_op=True)


def _all_gather(output: torch.Tensor, tensor: torch.Tensor, group):
    gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather_into(output, tensor, group=group, async_op=True)

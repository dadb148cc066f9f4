r"""Sparse, error-fed averaging of local SGD's pseudo-gradient: the sparsifying compressor between rounds.

At a synchronisation of local SGD or Local AdaAlter every rank ``i`` holds
its parameters ``x_i`` and the *anchor* ``x_a`` (the parameters every rank
shared when the round began). Instead of the dense mean of ``x_i``, each
rank sends its pseudo-gradient (DiLoCo, arXiv 2311.08105) through the
sparsifying compressor (:class:`~ddp_hooks.sparsify.compressor.SparseCompressor`,
the DDP hook's own, unchanged) with an error-feedback residual ``e_i``
(Eghlidi & Jaggi 2020, arXiv 2009.09271; SparseLoCo, arXiv 2508.15706):

.. math:: \Delta_i = x_a - x_i,\quad p_i = \Delta_i + e_i,\quad
          c_i = p_i \text{ on } S_i,\quad e_i \leftarrow p_i - c_i,\quad
          x \leftarrow x_a - \tfrac{1}{W}\textstyle\sum_j c_j

so every rank ends the synchronisation with the same ``x``, bit for bit,
and what a rank did not send is sent at a later synchronisation. An outer
optimizer then steps from ``x_a`` with ``x_a - x`` as its gradient. The
anchors live in the outer optimizer where there is one, else here.

Local AdaAlter's accumulators may go the same way: each rank's squared
gradients since the last averaging, sent sparsely with their own residuals
(:meth:`SparseAverage.mean_accumulators_`), so that ``B2`` grows by what
arrived and the rest arrives later.

Example (one process: the mean is the rank's own sparse pseudo-gradient)::

    >>> import os, tempfile, torch, torch.distributed as dist
    >>> store = os.path.join(tempfile.mkdtemp(), "store")
    >>> dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    >>> sparse = SparseAverage(method="random_block", density=0.25)
    >>> x = torch.zeros(8)
    >>> sparse.set_anchor([x])
    >>> _ = x.sub_(1.0)                  # a round of local steps moved every entry by -1
    >>> sparse.average_([x], sparse.anchors, group=None)   # (the averager then sets the next anchor)
    >>> int((x != 0).sum()), float(x.sum() - sparse.residual_total())   # 2 entries moved; nothing lost
    (2, -8.0)
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

import zlib
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from .._internal.collectives import world_size_and_rank
from ..sparsify.compressor import SparseCompressor
from ..sparsify.options import SparsifyOptions
from .anchors import check_anchors, restored_anchors

__all__ = ["SparseAverage", "sparse_settings"]

_STREAMS = ("parameters", "accumulators")


class SparseAverage:
    """Average the pseudo-gradient (and, if asked, the accumulators) sparsely, with error feedback.

    Args:
        method (str): the selector, as for the hook: ``"random_block"``
            (default), ``"shared_topk"``, ``"topk"``, ``"randomk"``.
        density (float): fraction of each parameter sent per averaging, in (0, 1].
        aggregation (str): ``"allreduce"`` or ``"allgather"``; by default the
            selector's own (AllGather for top-k, AllReduce otherwise).
        value_dtype (str): the dtype the values travel in (``"float32"``,
            ``"float16"``, ``"bfloat16"``; default float32, the dtype the
            pseudo-gradient is formed in, whatever the parameters' dtype).
        block_size (int): entries per block of ``random_block``.
        seed (int): seeds the random selectors (every rank must pass the same).

    The residuals are per rank, float32, one per parameter (and one per
    accumulator): a checkpoint of this object belongs to the rank that saved
    it (before its first exchange it holds none, and loads anywhere).
    Parameters of a lower precision than float32 cannot take every sent
    update exactly: what their rounding leaves out goes back into every
    rank's residual, and is sent again. ``counters`` (a :class:`~ddp_hooks.stats.CommStats` per stream,
    ``"parameters"`` and ``"accumulators"``) count what was sent against
    the dense exchange.
    """

    def __init__(self, method: str = "random_block", density: float = 0.01, aggregation: Optional[str] = None,
                 value_dtype: Optional[str] = None, block_size: int = 4, seed: int = 0) -> None:
        if aggregation is None:
            aggregation = "allgather" if method == "topk" else "allreduce"
        # density_warmup_steps=0: every averaging sends `density` (the hook's warm-up counts DDP steps)
        self.options = SparsifyOptions(method=method, density=density, aggregation=aggregation,
                                       value_dtype=value_dtype, block_size=block_size, seed=seed,
                                       density_warmup_steps=0)
        self.compressors = {stream: SparseCompressor(self.options) for stream in _STREAMS}
        self.exchanges = {stream: 0 for stream in _STREAMS}  # the draws' step, per stream
        self.anchors: Optional[List[torch.Tensor]] = None  # used where no outer optimizer holds them

    @property
    def counters(self):
        return {stream: compressor.counters for stream, compressor in self.compressors.items()}

    @property
    def has_anchor(self) -> bool:
        return self.anchors is not None

    @torch.no_grad()
    def set_anchor(self, params: Sequence[torch.Tensor]) -> None:
        """Remember ``params`` (the same on every rank) as the start of the next round."""
        if self.anchors is None or len(self.anchors) != len(params):
            self.anchors = [p.detach().clone() for p in params]
        else:
            for anchor, p in zip(self.anchors, params):
                anchor.copy_(p)

    @torch.no_grad()
    def average_(self, params: Sequence[torch.Tensor], anchors: Sequence[torch.Tensor], group) -> None:
        """``x = x_a - mean_j c_j`` in place, ``c_j`` rank ``j``'s sparse, error-fed ``x_a - x_j`` (module docstring)."""
        if len(anchors) != len(params):
            raise ValueError(f"SparseAverage got {len(params)} parameters but {len(anchors)} anchors")
        pseudo = torch.cat([(a.float() - p.detach().float()).reshape(-1) for a, p in zip(anchors, params)])
        mean = self._exchange("parameters", pseudo, params, group)
        offset = 0
        for p, anchor in zip(params, anchors):
            n = p.numel()
            exact = anchor.float().reshape(-1) - mean[offset:offset + n]
            p.copy_(exact.view_as(p))
            if p.dtype != torch.float32:  # the same rounding on every rank: each carries it, so its mean arrives
                self.compressors["parameters"].residuals.flat(0)[offset:offset + n].add_(
                    p.detach().reshape(-1).float() - exact)
            offset += n

    @torch.no_grad()
    def mean_accumulators_(self, accumulators: Sequence[torch.Tensor], group) -> None:
        """Replace each rank's accumulators by the mean of what the ranks sent of them (error-fed)."""
        flat = torch.cat([a.detach().float().reshape(-1) for a in accumulators])
        mean = self._exchange("accumulators", flat, accumulators, group)
        offset = 0
        for a in accumulators:
            n = a.numel()
            a.copy_(mean[offset:offset + n].view_as(a))
            offset += n

    def _exchange(self, stream: str, flat: torch.Tensor, tensors: Sequence[torch.Tensor], group) -> torch.Tensor:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("SparseAverage exchanges through torch.distributed and no process group is "
                               "initialised: call torch.distributed.init_process_group first (a single process "
                               "may join one of world size 1), or leave `sparse` out for dense averaging")
        # one unit per tensor, keyed apart per stream so that the two streams draw independent positions
        first = 0 if stream == "parameters" else len(tensors)
        layout, offset = [], 0
        for i, t in enumerate(tensors):
            layout.append((first + i, offset, t.numel()))
            offset += t.numel()
        step = self.exchanges[stream]
        self.exchanges[stream] = step + 1
        future = self.compressors[stream].exchange(flat, tuple(layout), group, step=step,
                                                   density=self.options.density)
        return future.wait()  # on a GPU: the current stream waits for the collective's

    def residual_total(self) -> float:
        """Sum of every residual entry (for tests and diagnostics)."""
        return float(sum(compressor.residuals.total() for compressor in self.compressors.values()))

    def state_dict(self, group=None) -> Dict[str, object]:
        """Options (as ints), the rank and world size in ``group`` that saved it, draws so far, residuals, anchors."""
        world, rank = world_size_and_rank(group)
        return {"config": self.options.config_ints(), "world_size": world, "rank": rank,
                "exchanges": dict(self.exchanges),
                "residuals": {stream: c.residuals.state() for stream, c in self.compressors.items()},
                "anchors": list(self.anchors or [])}

    def check_loadable(self, state: Dict[str, object], like: Sequence[torch.Tensor], group=None) -> None:
        """Raise ``ValueError`` unless ``state`` loads here: same options, same rank of the same world size
        (residuals belong to one rank), anchors shaped like ``like``."""
        if state["config"] != self.options.config_ints():
            raise ValueError(f"the checkpoint's sparse averaging was built with {state['config']} but this one "
                             f"with {self.options.config_ints()}; build it with the saved options to resume")
        world, rank = world_size_and_rank(group)
        exchanged = any(int(n) for n in state["exchanges"].values())  # (before the first: no residual yet)
        if exchanged and (int(state["world_size"]), int(state["rank"])) != (world, rank):
            raise ValueError(f"this sparse-averaging state was saved by rank {state['rank']} of "
                             f"{state['world_size']} and this is rank {rank} of {world}: its error-feedback "
                             "residuals belong to that rank alone; resume on the same ranks, each from its own file")
        check_anchors(list(state["anchors"]), like, "sparse-averaging")

    def load_state_dict(self, state: Dict[str, object], like: Sequence[torch.Tensor], group=None) -> None:
        """Restore what :meth:`state_dict` returned; ``like`` are the parameters (shapes, devices)."""
        self.check_loadable(state, like, group)
        self.exchanges = {stream: int(state["exchanges"][stream]) for stream in _STREAMS}
        for stream, compressor in self.compressors.items():
            compressor.residuals.load({int(k): v.to(like[0].device) for k, v in state["residuals"][stream].items()})
        self.anchors = restored_anchors(list(state["anchors"]), like)


def sparse_settings(sparse: Optional[SparseAverage]) -> Dict[str, int]:
    """The cross-rank checks' view of a sparse averaging (0: dense)."""
    if sparse is None:
        return {"sparse_average": 0}
    return {"sparse_average": zlib.crc32(repr(sorted(sparse.options.config_ints().items())).encode()) or 1}

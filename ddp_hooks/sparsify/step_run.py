"""One backward pass of the sparsifying hook: its exchanges in flight, and the buckets still waiting.

DDP hands the hook its buckets one at a time, in index order. The hook
starts each bucket's exchange at once but updates the per-rank states and
writes the results only when the whole step is known (finite or not), at
the last bucket. A :class:`StepRun`, created at bucket 0
(:meth:`~ddp_hooks.SparsifyState.begin_step`), holds what lies in between:
the exchanges started whose positions are still awaited
(:class:`StartedBucket`), the exchanges launched (:class:`~.exchange.Flight`), the buckets held back
for one global exchange (``scope="global"``), the loss scale read at the
first bucket, and the future every bucket's result waits on.

Example::

    >>> run = StepRun(scale=None)
    >>> run.busy, run.done.done()
    (False, False)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Tuple

import torch

from .exchange import Flight, Started
from .last_update import UpdateRecord
from .layout import Layout
from .sparse_output import SparseOutput

__all__ = ["StepRun", "StartedBucket", "WaitingBucket", "JoinedBuckets"]


@dataclass
class StartedBucket:
    """A bucket's exchange whose selection has started, and what its flight will carry to the commit."""

    exchange: Started
    update: Optional[UpdateRecord] = None  # optimizer momentum counted in sends
    result: Optional[SparseOutput] = None  # receives the result instead of the bucket
    outputs: Optional[List[torch.Tensor]] = None  # global scope: the bucket buffers that receive the result


class WaitingBucket(NamedTuple):
    """A bucket held back until the last one (``scope="global"``)."""

    buffer: torch.Tensor
    layout: Layout
    starts: torch.Tensor
    marks: torch.Tensor
    decay: Optional[torch.Tensor]


class JoinedBuckets(NamedTuple):
    """The waiting buckets laid end to end: one flat gradient with its layout, offsets, marks and decay."""

    grad: torch.Tensor
    layout: Layout
    starts: torch.Tensor
    marks: torch.Tensor
    decay: Optional[torch.Tensor]
    buffers: List[torch.Tensor]  # receive the joined result's chunks at the end of the step


class StepRun:
    """Exchanges launched in this backward, buckets waiting for the last one, the loss scale, completion."""

    __slots__ = ("started", "flights", "waiting", "scale", "done")

    def __init__(self, scale: Optional[torch.Tensor]) -> None:
        self.started: List[StartedBucket] = []  # in bucket order; sent by the hook a bucket later at most
        self.flights: List[Flight] = []  # in launch order
        self.waiting: List[WaitingBucket] = []
        self.scale = scale  # the loss scale S as a 0-dim tensor, or None without a grad scaler
        self.done: torch.futures.Future = torch.futures.Future()  # set once the step is committed

    @property
    def busy(self) -> bool:
        """True while some exchange (started or launched) or waiting bucket has not been committed."""
        return bool(self.started or self.flights or self.waiting)

    def join_waiting(self, with_decay: bool) -> JoinedBuckets:
        """Take the waiting buckets (leaving none) and lay them end to end."""
        waiting, self.waiting = self.waiting, []
        buffers = [w.buffer for w in waiting]
        layout, starts, shift = [], [], 0
        for w in waiting:
            layout.extend((key, offset + shift, n) for key, offset, n in w.layout)
            starts.append(w.starts + shift)
            shift += w.buffer.numel()
        decay = torch.cat([w.decay for w in waiting]) if with_decay else None
        return JoinedBuckets(grad=torch.cat(buffers), layout=tuple(layout), starts=torch.cat(starts),
                             marks=torch.cat([w.marks for w in waiting]), decay=decay, buffers=buffers)

    def take_started(self, keep_last: bool) -> List[StartedBucket]:
        """The started exchanges to send now, in bucket order: all, or all but the newest (``keep_last``)."""
        cut = len(self.started) - 1 if keep_last else len(self.started)
        taken, self.started = self.started[:cut], self.started[cut:]
        return taken

    def take_flights(self) -> Tuple[list, torch.futures.Future]:
        """The flights launched (leaving none) and the step's completion future."""
        flights, self.flights = self.flights, []
        return flights, self.done

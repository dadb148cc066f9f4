"""The bandwidth handshake between the cluster benchmark's controller and its ranks, through files.

The namespaces separate the hosts' networks, not their file systems, so a
folder in ``/tmp`` is a channel that no shaping touches. A change of rate:

1. every rank enters a barrier, so no collective is in flight;
2. rank 0 writes ``req-N`` holding the rate (``"100mbit"``, ``"unshaped"``);
3. the controller applies it with tc (:meth:`cluster.Cluster.set_rate`) and writes ``ack-N``;
4. every rank waits for ``ack-N`` and goes on.

A request ``sample`` changes nothing: the controller answers with its
counters in ``ack-N`` (with nodes, the bytes each node has sent to the others).

Files are written under a temporary name and renamed, so a reader never sees half of one.
"""

from __future__ import annotations

import json
import os
import time
from typing import Callable, Optional

__all__ = ["write_atomic", "request_path", "ack_path", "RankControl", "pending_request", "SAMPLE"]

POLL_S = 0.002
SAMPLE = "sample"  # a request that changes nothing: the answer holds the controller's counters


def write_atomic(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def request_path(folder: str, seq: int) -> str:
    return os.path.join(folder, f"req-{seq}")


def ack_path(folder: str, seq: int) -> str:
    return os.path.join(folder, f"ack-{seq}")


def pending_request(folder: str, seq: int) -> Optional[str]:
    """The rate of request ``seq`` if rank 0 has written it, else None (controller side)."""
    path = request_path(folder, seq)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return f.read()


class RankControl:
    """A rank's side: :meth:`switch` to a rate, waiting for the controller's answer.

    Args:
        folder (str): the control folder shared with the controller.
        rank (int): this rank; rank 0 writes the requests.
        timeout (float): seconds to wait for an answer before TimeoutError.
        barrier: called before each request (``torch.distributed.barrier``).
    """

    def __init__(self, folder: str, rank: int, timeout: float, barrier: Callable[[], None]):
        self.folder, self.rank, self.timeout, self._barrier = folder, rank, timeout, barrier
        self.seq = 0
        self.rate = "unshaped"  # the cluster starts unshaped

    def sample(self) -> Optional[list]:
        """The controller's counters (with nodes: the bytes each node has sent to the others), or None.

        Like a change of rate: a barrier, then request ``sample``, whose answer holds them as JSON.
        """
        self._barrier()
        if self.rank == 0:
            write_atomic(request_path(self.folder, self.seq), SAMPLE)
        ack = self._wait(SAMPLE)
        with open(ack) as f:
            return json.loads(f.read() or "null")

    def switch(self, rate: str) -> None:
        if rate == self.rate:
            return
        self._barrier()
        if self.rank == 0:
            write_atomic(request_path(self.folder, self.seq), rate)
        self._wait(rate)
        self.rate = rate

    def _wait(self, request: str) -> str:
        ack = ack_path(self.folder, self.seq)
        deadline = time.monotonic() + self.timeout
        while not os.path.exists(ack):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no answer from the controller to request {self.seq} ({request}) "
                                   f"within {self.timeout:g} s")
            time.sleep(POLL_S)
        self.seq += 1
        return ack

"""Non-finite gradients and parameters without one: the per-parameter marks of a bucket, and the verdict.

Each bucket is scanned once (:func:`scan`) for a mark per parameter: 0 when
its gradient is all zero (DDP zero-fills a parameter no rank used: its
residual is held, not sent), NaN when it holds an inf or NaN (which must
reach every rank, so that every rank discards the step alike), 1 otherwise.
After the exchange one verdict per step (:func:`holds_nonfinite` over what
arrived) decides whether the step is discarded; :class:`NonfiniteSteps`
counts the discarded steps without a host sync.

Example::

    >>> import torch
    >>> g = torch.tensor([0.0, 0.0, 1.0, 2.0, float("inf"), 3.0])
    >>> scan(g, list(g.split([2, 2, 2])), torch.tensor([0, 2, 4])).tolist()
    [0.0, 1.0, nan]
    >>> bool(holds_nonfinite(g)), bool(holds_nonfinite(g[:4]))
    (True, False)
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

__all__ = ["scan", "fill_if", "holds_nonfinite", "NonfiniteSteps"]


def scan(buffer: torch.Tensor, gradients: Sequence[torch.Tensor], starts: torch.Tensor) -> torch.Tensor:
    """Per parameter, a float32 mark of its gradient: 0 if all zero, NaN if it holds inf/NaN, else 1.

    ``buffer`` is the flat bucket, ``gradients`` its per-parameter views,
    ``starts`` their offsets (on the buffer's device).

    On the CPU, for float32 and float64, one read pass over the bucket:
    ``sum(buffer)`` is finite iff every entry is (an inf or NaN propagates
    into the sum; a sum that overflows is measured again per parameter), and
    a parameter whose first entry is non-zero has a gradient; the rare
    parameter whose first entry is zero is looked at in 8 more entries
    spread over it, and read whole only if they are all zero. The sum reads one
    vector, where the ``residual.add_(grad)`` that error feedback needs
    anyway reads two and writes one. Elsewhere, and for half precision, a
    parameter's mark comes from its ``max |g|`` (``aminmax``), with no host
    sync.
    """
    if not gradients:
        return torch.zeros(0)
    if buffer.device.type != "cpu" or buffer.dtype not in (torch.float32, torch.float64) or not buffer.numel():
        return _marks(torch.stack([_max_magnitude(g) for g in gradients]))
    if not torch.isfinite(buffer.sum()):  # an inf or NaN somewhere, or a sum that overflowed
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


def fill_if(tensor: torch.Tensor, flag: torch.Tensor, value: float, sync_free: Optional[bool] = None) -> None:
    """``tensor.fill_(value)`` if the 0-dim bool ``flag`` is set.

    On CPU the flag is read on the host (free there); on other devices a
    broadcast ``masked_fill_`` avoids a host sync, which would stall the
    backward pipeline.
    """
    if sync_free is None:
        sync_free = flag.device.type != "cpu"
    if sync_free:
        tensor.masked_fill_(flag, value)
    elif flag:
        tensor.fill_(value)


def holds_nonfinite(received: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool tensor: ``received`` holds an inf or NaN.

    On the CPU one float32 sum decides when it is finite (an inf or NaN
    propagates into it); only a sum that is not finite, which an overflow
    can also cause, is followed by the elementwise check. Elsewhere the
    elementwise check, which needs no host sync.
    """
    if received.device.type == "cpu" and bool(torch.isfinite(received.sum(dtype=torch.float32))):
        return torch.zeros((), dtype=torch.bool)
    return ~torch.isfinite(received).all()


class NonfiniteSteps:
    """The number of discarded steps, kept as a device tensor so that counting needs no host sync."""

    __slots__ = ("_count",)

    def __init__(self, start: int = 0) -> None:
        self._count: Optional[torch.Tensor] = None if not start else torch.tensor(start)

    def add(self, discarded: torch.Tensor) -> None:
        """Count one step if the 0-dim bool ``discarded`` is set."""
        if self._count is None or self._count.device != discarded.device:
            start = 0 if self._count is None else self._count.item()  # once, after a load
            self._count = torch.tensor(start, dtype=torch.int64, device=discarded.device)
        self._count.add_(discarded)

    def __int__(self) -> int:  # reading it waits for the device on CUDA
        return 0 if self._count is None else int(self._count)

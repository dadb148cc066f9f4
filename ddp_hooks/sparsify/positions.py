"""Gathers and scatters at the sent positions: plain copies when the positions are every position in order.

A step that sends every entry (density 1, or under AllGather the AllReduce
that replaces a costlier gather, :func:`~.exchange.sends_everything`) sends
at ``0, 1, ..., n - 1``. There a gather ``x[positions]`` is ``x`` itself, a
scatter ``x[positions] = v`` is ``x.copy_(v)``, and the parameter of each
position is its parameter's index repeated over the parameter's size, not
a binary search of ``n`` positions: the same values, bit for bit, without
``n`` random reads or writes, and without allocating a copy (on the CPU a
fresh tensor of a bucket's size costs more in page faults than the copy
itself). The exchange says which steps are *whole* (``Flight.whole``);
every function here takes that flag and does the general indexed operation
without it. The positions themselves, ``0 .. n-1`` as int64, are one tensor
per size and device (:func:`every_position`), kept while some step holds
it.

Example::

    >>> import torch
    >>> x = torch.tensor([5.0, 6.0, 7.0, 8.0])
    >>> every = torch.arange(4)
    >>> torch.equal(gather(x, every, whole=True), gather(x, every, whole=False))
    True
    >>> gather(x, every, whole=True) is x   # to read, not to write
    True
    >>> put(torch.zeros(4), torch.tensor([3, 0]), torch.tensor([1.0, 2.0]), whole=False).tolist()
    [2.0, 0.0, 0.0, 1.0]
    >>> starts = torch.tensor([0, 1, 1, 3])   # four parameters of sizes 1, 0, 2 and 1
    >>> owners(starts, every, 4, whole=True).tolist(), owners(starts, every, 4, whole=False).tolist()
    ([0, 2, 2, 3], [0, 2, 2, 3])
"""

from __future__ import annotations

import threading
import weakref

import torch

__all__ = ["every_position", "gather", "put", "zero_at", "owners"]

_every: "weakref.WeakValueDictionary[tuple, torch.Tensor]" = weakref.WeakValueDictionary()
_every_lock = threading.Lock()


def every_position(numel: int, device: torch.device) -> torch.Tensor:
    """``torch.arange(numel)`` on ``device``, one shared tensor while any holder keeps it (never write to it)."""
    key = (int(numel), str(torch.device(device)))
    with _every_lock:
        positions = _every.get(key)
        if positions is None:
            positions = _every[key] = torch.arange(numel, device=device)
        return positions


def gather(source: torch.Tensor, positions: torch.Tensor, whole: bool) -> torch.Tensor:
    """``source[positions]``, to be read only: a new tensor, or with ``whole`` (positions ``0 .. n-1``) ``source``."""
    return source if whole else source.index_select(0, positions)


def put(target: torch.Tensor, positions: torch.Tensor, values: torch.Tensor, whole: bool) -> torch.Tensor:
    """``target[positions] = values`` in place for distinct ``positions`` (``values`` of ``target``'s dtype).

    Without ``whole`` a ``scatter_``: on the CPU a plain strided loop, faster
    than ``index_copy_`` or ``index_put_`` (``bench/bench_sparsify_kernels.py``).
    """
    return target.copy_(values) if whole else target.scatter_(0, positions, values)


def zero_at(target: torch.Tensor, positions: torch.Tensor, whole: bool = False) -> torch.Tensor:
    """``target[positions] = 0`` in place for distinct ``positions`` of a 1-D ``target``.

    A ``scatter_`` from a zero vector, where ``index_fill_`` takes a slower
    general path on the CPU; with ``whole`` a ``zero_``.
    """
    if whole:
        return target.zero_()
    return target.scatter_(0, positions, torch.zeros(positions.numel(), dtype=target.dtype, device=target.device))


def owners(starts: torch.Tensor, positions: torch.Tensor, numel: int, whole: bool) -> torch.Tensor:
    """The parameter of each position: its index into ``starts``, the increasing offsets where parameters start.

    ``starts[0]`` is 0 and every position lies in ``[0, numel)``, so each has
    one (parameters of no entries own none).
    """
    if whole:
        sizes = torch.diff(starts, append=starts.new_full((1,), numel))
        every_parameter = torch.arange(starts.numel(), device=starts.device)
        return torch.repeat_interleave(every_parameter, sizes, output_size=numel)
    return torch.searchsorted(starts, positions, right=True) - 1

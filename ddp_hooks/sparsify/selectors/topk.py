"""Top-k: the k entries of largest magnitude per unit, exact, for many units at once.

For each unit ``u`` (a range ``[offset_u, offset_u + n_u)`` of a flat vector
with budget ``k_u``) the positions of the ``k_u`` largest magnitudes are
wanted. ``torch.topk`` over millions of entries costs tens of passes over
them, and one call per layer multiplies the fixed costs. Instead:

1. ``|p|`` once over the whole vector (by the caller, into reusable memory);
2. per unit, a threshold ``t_u`` from an evenly strided sample of ``|p|``,
   aimed at about ``1.5 k_u`` entries above it (small units: ``t_u = 0``, every
   entry is a candidate);
3. one candidate mask ``|p| >= t_u`` and its positions (:func:`true_positions`);
4. the exact top ``k_u`` of each unit's candidates by one segmented sort
   (:func:`smallest_per_segment`).

Every entry above the ``k_u``-th largest magnitude is above ``t_u`` whenever
at least ``k_u`` entries are, so the result is the exact top-k. A unit whose
sample misled (fewer than ``k_u`` candidates), and a large unit whose budget
is a big fraction of it, gets a plain ``torch.topk`` instead: the sample only
changes the speed, never the result. Ties between equal magnitudes go to the
lower position.

Steps 3 and 4 read counts on the host (the candidates' number, the units
short of candidates): free on the CPU, a stall of the stream on a GPU. Where
the request may not read on the host
(:attr:`~.base.SelectionRequest.reads_on_host`), each unit takes one
``torch.topk`` of an int64 key that orders by magnitude, then by lower
position: the same positions in the same order, with sizes the host knows.

Example::

    >>> import torch
    >>> p = torch.tensor([0.5, -4.0, 1.0, 3.0, 0.0, -2.0])
    >>> topk_units(p.abs(), offsets=[0, 3], sizes=[3, 3], ks=[2, 1]).tolist()
    [1, 2, 3]
"""

from __future__ import annotations

from functools import lru_cache
from typing import List, Optional, Sequence, Tuple

import torch

from .base import SelectionRequest, Selector

__all__ = ["TopK", "topk_units", "unit_tensors", "true_positions", "smallest_per_segment"]

# Units smaller than this take every entry as a candidate (no sampling).
_SMALL = 1 << 12
# Units whose budget exceeds 1/_SPARSE of them use torch.topk directly.
_SPARSE = 8
# Candidates aimed at per unit, as a multiple of its budget.
_AIM = 1.5
# Sampled entries expected above each threshold (sets the sample size).
_HITS = 128
_INT32_MAX = (1 << 31) - 1


def _threshold(magnitude: torch.Tensor, k: int) -> torch.Tensor:
    """A magnitude with about ``_AIM * k`` entries of ``magnitude`` at or above it."""
    n = magnitude.numel()
    samples = min(n, max(1024, int(_HITS * n / (_AIM * k))))
    sample = magnitude[:: max(1, n // samples)]
    above = max(1, int(sample.numel() * _AIM * k / n))
    return sample.kthvalue(max(1, sample.numel() - above + 1)).values


@lru_cache(maxsize=256)
def unit_tensors(offsets: Tuple[int, ...], ks: Tuple[int, ...], device: torch.device):
    """The units' offsets and budgets as int64 tensors on ``device``, kept: a bucket's repeat from step to step."""
    return (torch.tensor(offsets, dtype=torch.int64, device=device),
            torch.tensor(ks, dtype=torch.int64, device=device))


def topk_units(magnitude: torch.Tensor, offsets: Sequence[int], sizes: Sequence[int], ks: Sequence[int],
               mask: Optional[torch.Tensor] = None, reads_on_host: Optional[bool] = None) -> torch.Tensor:
    """Absolute positions of the ``ks[u]`` largest ``magnitude`` entries in each unit, unit by unit.

    Args:
        magnitude (Tensor): flat non-negative float vector holding the units
            (``|p|``: the caller takes the absolute value, into memory it may reuse).
        offsets, sizes (ints): each unit's first position and length;
            offsets must increase and units must not overlap.
        ks (ints): each unit's budget, ``1 <= ks[u] <= sizes[u]``.
        mask (Tensor): optional bool scratch of at least ``magnitude.numel()``
            rounded up to a multiple of 8, reused instead of a new allocation.
        reads_on_host (bool): whether counts may be read on the host (default:
            on the CPU only); without, one ``torch.topk`` per unit.
    """
    device = magnitude.device
    if not (device.type == "cpu" if reads_on_host is None else reads_on_host):
        return torch.cat([_top_of_unit(magnitude[o:o + n], k).add_(o) for o, n, k in zip(offsets, sizes, ks)])
    padded = (magnitude.numel() + 7) // 8 * 8
    if mask is None or mask.numel() < padded:
        mask = torch.zeros(padded, dtype=torch.bool, device=device)
    else:
        mask = mask[:padded].zero_()
    direct: List[int] = []  # units answered by torch.topk
    for u, (o, n, k) in enumerate(zip(offsets, sizes, ks)):
        if n < _SMALL:
            mask[o:o + n] = True
        elif _SPARSE * k > n:
            direct.append(u)
        else:
            piece = magnitude[o:o + n]
            torch.ge(piece, _threshold(piece, k), out=mask[o:o + n])
    candidates = true_positions(mask)
    offsets_t, ks_t = unit_tensors(tuple(offsets), tuple(ks), device)
    unit = torch.searchsorted(offsets_t, candidates, right=True) - 1
    found = torch.bincount(unit, minlength=len(ks))
    short = [u for u in torch.nonzero(found < ks_t).squeeze(1).tolist() if u not in direct]
    direct = sorted(direct + short)
    if direct:
        ks_t = ks_t.clone()
        ks_t[direct] = 0  # their candidates, if any, are dropped below
    # Sort by unit, then by decreasing magnitude: the bits of a non-negative
    # float32 order like the floats, so the key is INT32_MAX - bits.
    key = _INT32_MAX - magnitude.index_select(0, candidates).float().view(torch.int32).long()
    chosen = candidates.index_select(0, smallest_per_segment(unit, key, ks_t, len(ks)))
    if not direct:
        return chosen
    parts: List[torch.Tensor] = []
    taken = 0
    for u, (o, n, k) in enumerate(zip(offsets, sizes, ks)):
        if u in direct:
            parts.append(torch.topk(magnitude[o:o + n], k, sorted=False).indices.add_(o))
        else:
            parts.append(chosen[taken:taken + k])
            taken += k
    return torch.cat(parts)


def _top_of_unit(magnitude: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` largest entries' positions, by decreasing magnitude, ties to the lower position: no host read.

    The key is the magnitude's float32 bits (which order like the floats)
    above the position's complement, so ``torch.topk`` of distinct int64s
    breaks no tie of its own.
    """
    n = magnitude.numel()
    key = magnitude.float().view(torch.int32).long().mul_(2**31)
    key.add_(torch.arange(_INT32_MAX, _INT32_MAX - n, -1, device=magnitude.device))
    return torch.topk(key, k, sorted=True).indices


def true_positions(mask: torch.Tensor) -> torch.Tensor:
    """Sorted positions of the True entries of a 1-D bool tensor (``nonzero``, but faster when sparse).

    ``torch.nonzero`` visits every byte; here the mask is read as int64 words
    of 8 bools, ``nonzero`` runs over the words (8x fewer entries), and only
    the words holding a True are expanded: when few words hold one, as
    at the densities the hook runs, that touches far fewer entries.
    """
    n = mask.numel()
    if n % 8 or n < 1024 or mask.storage_offset() % 8:
        return torch.nonzero(mask).squeeze(1)
    words = torch.nonzero(mask.view(torch.int64)).squeeze(1)
    bytes_of_words = mask.view(-1, 8).index_select(0, words).view(-1)
    inside = torch.nonzero(bytes_of_words).squeeze(1)
    return (words.index_select(0, inside >> 3) << 3) | (inside & 7)


def smallest_per_segment(segment: torch.Tensor, key: torch.Tensor, counts: torch.Tensor,
                         num_segments: int) -> torch.Tensor:
    """Indices of the ``counts[s]`` smallest ``key`` entries of each segment ``s``, segment by segment.

    Args:
        segment (Tensor): int64 segment id of each entry, in ``[0, num_segments)``.
        key (Tensor): int64 sort key of each entry, in ``[0, 2**(63 - bits))``
            where ``bits`` is the bit length of ``num_segments``.
        counts (Tensor): int64, how many to keep per segment; each segment
            must have at least that many entries.
        num_segments (int): number of segments.

    Returns:
        Indices into the inputs, grouped by segment in segment order and, within
        a segment, by increasing key (ties in input order).
    """
    bits = max(1, int(num_segments).bit_length())
    composite = (segment << (63 - bits)) | key
    order = torch.sort(composite, stable=True).indices
    sorted_segment = segment.index_select(0, order)
    sizes = torch.bincount(segment, minlength=num_segments)
    starts = torch.cumsum(sizes, 0) - sizes
    rank = torch.arange(order.numel(), device=order.device) - starts.index_select(0, sorted_segment)
    keep = rank < counts.index_select(0, sorted_segment)
    return order[keep]


class TopK(Selector):
    """Each rank's own k largest ``|p|`` per unit; its positions travel with its values (AllGather only)."""

    name = "topk"
    code = 0
    aggregations = ("allgather",)
    aggregation_reason = ("each rank's top-k entries sit at different positions, so values alone cannot be "
                          "summed")
    positions_travel = True
    reads_values = True

    def choose(self, request: SelectionRequest, ks: Tuple[int, ...]) -> torch.Tensor:
        units = request.units
        return topk_units(request.magnitude, [u.offset for u in units], [u.numel for u in units], ks,
                          request.scratch_mask, request.reads_on_host)

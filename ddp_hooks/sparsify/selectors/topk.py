"""Top-k: the k entries of largest magnitude per unit, exact, for many units at once.

For each unit ``u`` (a range ``[offset_u, offset_u + n_u)`` of a flat vector
with budget ``k_u``) the positions of the ``k_u`` largest magnitudes are
wanted. ``torch.topk`` over millions of entries costs tens of passes over
them, and one call per layer multiplies the fixed costs. Instead:

1. ``|p|`` once over the whole vector (by the caller, into reusable memory);
2. per unit, a threshold ``t_u`` from an evenly strided sample of ``|p|``,
   aimed at about ``1.5 k_u`` entries above it (small units: ``t_u = 0``, every
   entry is a candidate);
3. one candidate mask ``|p| >= t_u`` and its positions
   (:func:`~.segments.true_positions`);
4. the exact top ``k_u`` of each unit's candidates by one segmented sort
   (:func:`~.segments.smallest_per_segment`).

Every entry above the ``k_u``-th largest magnitude is above ``t_u`` whenever
at least ``k_u`` entries are, so the result is the exact top-k. A unit whose
sample misled (fewer than ``k_u`` candidates), and a large unit whose budget
is a big fraction of it, gets a plain ``torch.topk`` instead: the sample only
changes the speed, never the result. Ties between equal magnitudes go to the
lower position.

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
from .segments import smallest_per_segment, true_positions

__all__ = ["TopK", "topk_units"]

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
def _unit_tensors(offsets: Tuple[int, ...], ks: Tuple[int, ...], device: torch.device):
    return torch.tensor(offsets, device=device), torch.tensor(ks, device=device)


def topk_units(magnitude: torch.Tensor, offsets: Sequence[int], sizes: Sequence[int], ks: Sequence[int],
               mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Absolute positions of the ``ks[u]`` largest ``magnitude`` entries in each unit, unit by unit.

    Args:
        magnitude (Tensor): flat non-negative float vector holding the units
            (``|p|``: the caller takes the absolute value, into memory it may reuse).
        offsets, sizes (ints): each unit's first position and length;
            offsets must increase and units must not overlap.
        ks (ints): each unit's budget, ``1 <= ks[u] <= sizes[u]``.
        mask (Tensor): optional bool scratch of at least ``magnitude.numel()``
            rounded up to a multiple of 8, reused instead of a new allocation.
    """
    device = magnitude.device
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
    offsets_t, ks_t = _unit_tensors(tuple(offsets), tuple(ks), device)
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
                          request.scratch_mask)

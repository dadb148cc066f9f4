"""Vectorised helpers over *segments*: many units of selection handled in one pass.

A selector that loops over a bucket's 50 layers pays 50 times the fixed cost
of every tensor operation; these helpers let it pay once. They are pure tensor
functions used by the top-k selector (:mod:`.topk`) and
the random-k selector (:mod:`.randomk`).

Example::

    >>> import torch
    >>> mask = torch.zeros(20, dtype=torch.bool)
    >>> mask[[3, 4, 17]] = True
    >>> true_positions(mask).tolist()
    [3, 4, 17]
    >>> # keep the 1 smallest key of segment 0 and the 2 smallest of segment 1
    >>> seg = torch.tensor([0, 0, 1, 1, 1])
    >>> key = torch.tensor([5, 2, 9, 1, 4])
    >>> smallest_per_segment(seg, key, torch.tensor([1, 2]), 2).tolist()
    [1, 3, 4]
"""

from __future__ import annotations

import torch

__all__ = ["true_positions", "smallest_per_segment"]


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

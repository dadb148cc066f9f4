"""Where each parameter sits in DDP's flat buckets, and the stable key that names it.

A *layout* lists, for each parameter of a bucket, ``(key, offset, numel)``.
Keys number the parameters in the order the hook first meets them, which is
the same in every run of the same model (DDP hands over its initial buckets
in a fixed order), so everything the hook keeps per parameter (residuals,
velocities, last updates) is saved and loaded by key and follows its
parameter when DDP rebuilds its buckets.

Example::

    >>> import torch
    >>> layouts = BucketLayouts()
    >>> a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
    >>> layout, starts = layouts.of_bucket(0, [a, b], [torch.zeros(3), torch.zeros(2)], offsets=[0, 3])
    >>> layout, starts.tolist(), layouts.key_of(b)
    (((0, 0, 3), (1, 3, 2)), [0, 3], 1)
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import torch

__all__ = ["Layout", "GLOBAL_BUCKET", "BucketLayouts"]

#: For each parameter of a bucket: (parameter key, offset, numel).
Layout = Tuple[Tuple[int, int, int], ...]

#: Index under which ``scope="global"`` keeps its per-rank states for all buckets of a step,
#: laid out like their concatenation.
GLOBAL_BUCKET = -1


class BucketLayouts:
    """Parameter keys, and each bucket index's layout with the offsets where its parameters start."""

    __slots__ = ("keys", "_by_bucket")

    def __init__(self) -> None:
        self.keys: Dict[int, int] = {}  # id(parameter) -> key
        self._by_bucket: Dict[int, Tuple[Tuple[int, ...], Layout, torch.Tensor]] = {}

    def key_of(self, param: torch.Tensor) -> Optional[int]:
        """The key of ``param``, or ``None`` if the hook has not met it."""
        return self.keys.get(id(param))

    def knows_any(self, params) -> bool:
        return any(id(p) in self.keys for p in params)

    def of_bucket(self, index: int, params: Sequence[torch.Tensor], gradients: Sequence[torch.Tensor],
                  offsets: Sequence[int]) -> Tuple[Layout, torch.Tensor]:
        """The layout of bucket ``index`` and, on the gradients' device, its parameters' start offsets.

        ``offsets`` are the parameters' positions in the flat bucket; they
        must increase (the hook maps positions to parameters by binary search).
        """
        ids = tuple(id(p) for p in params)
        cached = self._by_bucket.get(index)
        if cached is not None and cached[0] == ids:
            return cached[1], cached[2]
        layout = tuple((self.keys.setdefault(id(p), len(self.keys)), offset, g.numel())
                       for p, g, offset in zip(params, gradients, offsets))
        offsets = list(offsets)
        if offsets != sorted(offsets):
            raise RuntimeError(f"DDP bucket {index} lays out its parameters at offsets {offsets}, "
                               "not in increasing order; sparsify_hook cannot map positions to parameters")
        device = gradients[0].device if gradients else torch.device("cpu")
        starts = torch.tensor(offsets, dtype=torch.int64, device=device)
        self._by_bucket[index] = (ids, layout, starts)
        return layout, starts

    def of_ddp_bucket(self, bucket) -> Tuple[Layout, torch.Tensor]:
        """:meth:`of_bucket` for a ``dist.GradBucket``: offsets from its gradients' places in its buffer."""
        params = bucket.parameters()
        cached = self._by_bucket.get(bucket.index())
        if cached is not None and cached[0] == tuple(id(p) for p in params):
            return cached[1], cached[2]
        buffer, gradients = bucket.buffer(), bucket.gradients()
        base, size = buffer.data_ptr(), buffer.element_size()
        offsets, end = [], 0
        for g in gradients:
            # an empty gradient's data pointer may be anything (often 0): place it where the previous one ended
            offset = (g.data_ptr() - base) // size if g.numel() else end
            offsets.append(offset)
            end = offset + g.numel()
        return self.of_bucket(bucket.index(), params, gradients, offsets)

    def drop_buckets_after(self, last_index: int) -> None:
        """Forget bucket indices past the last one (left over from a rebuild)."""
        for index in [i for i in self._by_bucket if i > last_index]:
            del self._by_bucket[index]

    def forget_buckets(self) -> None:
        """Forget every bucket's layout (the keys stay): after a load, layouts are rebuilt at the next step."""
        self._by_bucket.clear()

r"""Float32 result vectors kept at zero between steps, so a sparse result costs O(k) to write, not O(n).

A sparsified step's result is zero except at the ``k`` positions some rank
sent. Writing it into DDP's bucket buffer means zeroing the whole buffer
first, a full write of the gradient's size (bench/README.md, "The hook's own work,
per bucket", measures what avoiding it saves: ``bench/compare_result_paths.py``).
Instead the hook can return a
vector of its own: DDP copies a hook's result into ``.grad`` from whatever
tensor the future holds, exactly as it copies from its own buffer. This
vector stays zero except where the previous step wrote, so clearing it
touches only those positions.

Used on the CPU for float32 buckets whose gradients are not views of the
bucket (``gradient_as_bucket_view=False``, DDP's default): there DDP copies
the result into ``.grad`` in any case. With ``gradient_as_bucket_view=True``
the result must land in the bucket itself (anything else costs DDP one more
full copy), and on GPUs a zero fill is cheap, so the hook writes into the
bucket as PyTorch's hooks do. Memory: one float32 vector per bucket, the
gradients' size in all.

Example::

    >>> import torch
    >>> out = SparseOutput(8, torch.device("cpu"))
    >>> target = out.clear()
    >>> target[torch.tensor([1, 5])] = 3.0
    >>> out.written = [torch.tensor([1, 5])]
    >>> out.clear().tolist()
    [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
"""

from typing import Dict, List, Optional, Sequence

import torch

from .positions import zero_at

__all__ = ["SparseOutput", "SparseOutputs"]


class SparseOutput:
    """One bucket's result vector and the positions last written into it (``None``: unknown)."""

    __slots__ = ("tensor", "written")

    def __init__(self, numel: int, device: torch.device):
        self.tensor = torch.zeros(numel, dtype=torch.float32, device=device)
        self.written: Optional[List[torch.Tensor]] = []

    def clear(self) -> torch.Tensor:
        """Zero what the last write touched and return the (all-zero) vector; ``written`` becomes unknown."""
        written, self.written = self.written, None
        if written is None or 4 * sum(p.numel() for p in written) >= self.tensor.numel():
            self.tensor.zero_()  # unknown, or so many positions that one pass is cheaper
        else:
            for positions in written:
                zero_at(self.tensor, positions)
        return self.tensor

    def overwrite(self) -> torch.Tensor:
        """The vector, for a write at every position (nothing to zero first); ``written`` becomes unknown."""
        self.written = None
        return self.tensor


class SparseOutputs:
    """The :class:`SparseOutput` of each bucket index (CPU only), remade when the bucket's size changes."""

    def __init__(self):
        self._by_bucket: Dict[int, SparseOutput] = {}

    def for_bucket(self, index: int, buffer: torch.Tensor, gradients: Sequence[torch.Tensor],
                   params: Sequence[torch.Tensor]) -> Optional[SparseOutput]:
        """The bucket's result vector, or ``None`` where the result belongs in ``buffer`` itself (see above)."""
        if buffer.device.type != "cpu" or buffer.dtype != torch.float32 or _grads_are_bucket_views(gradients, params):
            return None
        out = self._by_bucket.get(index)
        if out is None or out.tensor.numel() != buffer.numel():
            out = self._by_bucket[index] = SparseOutput(buffer.numel(), buffer.device)
        return out

    @property
    def in_use(self) -> bool:
        """True once some bucket's result went to a vector of this store rather than into the bucket."""
        return bool(self._by_bucket)

    def drop_buckets_after(self, last_index: int) -> None:
        """Forget the vectors of bucket indices past the step's last bucket (DDP rebuilt fewer buckets)."""
        for index in [i for i in self._by_bucket if i > last_index]:
            del self._by_bucket[index]


def _grads_are_bucket_views(gradients: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> bool:
    """True when DDP runs with ``gradient_as_bucket_view=True``: a parameter's ``.grad`` is its bucket view."""
    return any(p.grad is not None and p.grad.data_ptr() == g.data_ptr() for p, g in zip(params, gradients))

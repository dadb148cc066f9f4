"""Error-feedback residuals (and momentum velocities), stored flat per DDP bucket and keyed by parameter.

Each bucket's residual is one float32 vector laid out like the bucket's flat
gradient buffer, on the same device, so compensation is a single in-place
``add_``. The store also remembers which parameter owns which slice. DDP
rebuilds its buckets after the first iteration (and with ``static_graph``
later), regrouping parameters under new bucket indices; when a bucket index
shows up with a new layout, its new residual vector is assembled parameter by
parameter from wherever each parameter's residual lived before, so no
residual mass is lost and no warm-up is needed (PyTorch's PowerSGD instead
requires ``start_powerSGD_iter > 1`` and relies on a plain allreduce until the
rebuild; see PyTorch issues 48670 and 48867).

Residuals are float32 even when gradients are fp16/bf16: the residual
accumulates many small leftovers that a half-precision vector would round away.
:class:`~ddp_hooks.SparsifyState` keeps its per-rank momentum velocities in a
second store of the same kind, so they follow their parameters alike.

Example::

    >>> import torch
    >>> from ddp_hooks.sparsify.residuals import ResidualStore
    >>> store = ResidualStore()
    >>> e = store.bucket_residual(0, ((0, 0, 2), (1, 2, 3)), 5, torch.device("cpu"))
    >>> e.add_(1.0).tolist()
    [1.0, 1.0, 1.0, 1.0, 1.0]
    >>> # after a rebuild parameter 1 sits first in bucket 0: its residual follows it
    >>> store.bucket_residual(0, ((1, 0, 3),), 3, torch.device("cpu")).tolist()
    [1.0, 1.0, 1.0]
"""

from __future__ import annotations

from typing import Dict

import torch

from .layout import Layout



class ResidualStore:
    """Per-bucket flat float32 residuals that follow their parameters across rebuilds."""

    __slots__ = ("_flat", "_layout", "_views", "_pending")

    def __init__(self) -> None:
        self._flat: Dict[int, torch.Tensor] = {}  # bucket index -> flat residual
        self._layout: Dict[int, Layout] = {}  # bucket index -> layout of that flat
        self._views: Dict[int, torch.Tensor] = {}  # parameter key -> its slice of some flat
        self._pending: Dict[int, torch.Tensor] = {}  # loaded from a checkpoint, not yet placed

    def bucket_residual(self, bucket_index: int, layout: Layout, numel: int, device: torch.device) -> torch.Tensor:
        """The residual vector of a bucket with this layout, (re)assembled if needed."""
        flat = self._flat.get(bucket_index)
        if flat is not None and self._layout[bucket_index] == layout and flat.device == device:
            return flat
        flat = torch.zeros(numel, dtype=torch.float32, device=device)
        for key, offset, n in layout:
            source = self._views.get(key)
            if source is None:
                source = self._pending.pop(key, None)
            if source is not None:
                if source.numel() != n:
                    raise ValueError(
                        f"the error-feedback residual of parameter #{key} has {source.numel()} elements but "
                        f"the parameter has {n}: the hook state was saved from a different model"
                    )
                flat[offset : offset + n].copy_(source.reshape(-1))
        for key, offset, n in layout:
            self._views[key] = flat[offset : offset + n]
        self._flat[bucket_index] = flat
        self._layout[bucket_index] = layout
        return flat

    def flat(self, bucket_index: int) -> torch.Tensor:
        """The current flat vector of a bucket (after :meth:`bucket_residual` placed it this step)."""
        return self._flat[bucket_index]

    def drop_buckets_after(self, last_index: int) -> None:
        """Forget bucket indices past the last one (left over from a rebuild); keeps ``GLOBAL_BUCKET``."""
        for index in [i for i in self._flat if i > last_index]:
            del self._flat[index]
            del self._layout[index]

    def of_key(self, key: int):
        """A copy of parameter ``key``'s flat residual (placed or loaded), or ``None`` if it has none."""
        source = self._views.get(key)
        if source is None:
            source = self._pending.get(key)
        return None if source is None else source.detach().clone()

    @property
    def pending_keys(self):
        return sorted(self._pending)

    def state(self) -> Dict[int, torch.Tensor]:
        """Residual per parameter key (copies), including any not yet placed."""
        out = {key: view.detach().clone() for key, view in self._views.items()}
        for key, tensor in self._pending.items():
            out.setdefault(key, tensor.detach().clone())
        return dict(sorted(out.items()))

    def load(self, residuals: Dict[int, torch.Tensor]) -> None:
        """Replace all residuals; they are placed when their parameters' buckets arrive."""
        self._flat.clear()
        self._layout.clear()
        self._views.clear()
        self._pending = {int(k): v.detach().to(torch.float32).reshape(-1).clone() for k, v in residuals.items()}

    def total(self) -> torch.Tensor:
        """Sum of all residual entries (for tests and diagnostics)."""
        tensors = list(self._views.values()) + list(self._pending.values())
        if not tensors:
            return torch.zeros((), dtype=torch.float64)
        return sum(t.double().sum().cpu() for t in tensors)

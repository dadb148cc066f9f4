r"""What the sparsifier keeps from step to step, per parameter: layouts, residuals, last updates, result vectors.

Everything a rank keeps for a parameter is keyed by the parameter's key, not
by the bucket it sits in. :class:`BucketLayouts` numbers the parameters in
the order the hook first meets them, the same in every run of the same model,
and gives each bucket's *layout*, ``(key, offset, numel)`` per parameter:
DDP rebuilds its buckets after the first iteration (and with ``static_graph``
later), regrouping parameters under new bucket indices, and a checkpoint
resumes on DDP's initial buckets.

* :class:`ResidualStore`: the error-feedback residuals (and, in a second
  store, the momentum velocities), one float32 vector per bucket laid out
  like the bucket, so compensation is a single ``add_``; when a bucket index
  shows up with a new layout its vector is assembled parameter by parameter
  from wherever each parameter's lived before, so no residual mass is lost
  and no warm-up is needed (PyTorch's PowerSGD instead requires
  ``start_powerSGD_iter > 1``; PyTorch issues 48670 and 48867). Float32 even
  for half-precision gradients: the residual accumulates many small
  leftovers that a half vector would round away.
* :class:`LastUpdates`: the averaged update each bucket received at the last
  step, kept sparse (O(k)), for the optimizer's momentum counted in sends.
* :class:`SparseOutputs`: float32 result vectors kept at zero between steps,
  so that a sparse result costs O(k) to write, not O(n) (CPU only).
* :class:`ScratchMemory`: top-k's ``|p|`` and candidate mask, reused.
* :class:`NonfiniteSteps`: the count of discarded steps, on the device.

And how they are read and written at the sent positions (:func:`gather`,
:func:`put`, :func:`zero_at`, :func:`owners`): a step that sends every entry
(density 1, or under AllGather the AllReduce that replaces a costlier
gather) sends at ``0, 1, ..., n - 1``, where a gather is the vector itself,
a scatter a copy, and the parameter of each position its parameter's index
repeated: the same values, bit for bit, without ``n`` random reads or
writes. Such steps are *whole*; every function takes that flag.

Example::

    >>> import torch
    >>> store = ResidualStore()
    >>> e = store.bucket_residual(0, ((0, 0, 2), (1, 2, 3)), 5, torch.device("cpu"))
    >>> e.add_(1.0).tolist()
    [1.0, 1.0, 1.0, 1.0, 1.0]
    >>> # after a rebuild parameter 1 sits first in bucket 0: its residual follows it
    >>> store.bucket_residual(0, ((1, 0, 3),), 3, torch.device("cpu")).tolist()
    [1.0, 1.0, 1.0]
"""

from __future__ import annotations

import threading
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

import torch


__all__ = ["Layout", "GLOBAL_BUCKET", "BucketLayouts", "ResidualStore", "LastUpdates", "SparseOutput", "SparseOutputs", "ScratchMemory",
           "NonfiniteSteps", "every_position", "gather", "put", "zero_at", "owners"]

#: For each parameter of a bucket: (parameter key, offset, numel).
Layout = Tuple[Tuple[int, int, int], ...]

#: Index under which ``scope="global"`` keeps its per-rank states for all buckets of a step,
#: laid out like their concatenation.
GLOBAL_BUCKET = -1


# ----- at the sent positions -----
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


# ----- the stores -----
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


Entries = Tuple[torch.Tensor, torch.Tensor]  # (int64 positions, float32 values)
LastUpdate = Tuple[torch.Tensor, torch.Tensor, bool]  # (positions, values, whole)


class LastUpdates:
    """Per bucket, the positions and values of the last averaged update, following parameters across rebuilds.

    A bucket's entry is ``(positions, values, whole)``: int64 positions, float32
    values, and whether the positions are every position in order. A position
    may repeat (under AllGather ranks overlap): only its first entry holds a
    value, the others hold 0.

    Example::

        >>> import torch
        >>> store = LastUpdates()
        >>> store.put(0, ((0, 0, 4), (1, 4, 4)), torch.tensor([1, 6]), torch.tensor([0.5, -2.0]))
        >>> positions, values, whole = store.get(0, ((0, 0, 4), (1, 4, 4)), torch.device("cpu"))
        >>> positions.tolist(), values.tolist(), whole
        ([1, 6], [0.5, -2.0], False)
        >>> # after a rebuild parameter 1 comes first in bucket 0: its entry follows it
        >>> positions, values, _ = store.get(0, ((1, 0, 4),), torch.device("cpu"))
        >>> positions.tolist(), values.tolist()
        ([2], [-2.0])
    """

    __slots__ = ("_by_bucket", "_pending")

    def __init__(self) -> None:
        self._by_bucket: Dict[int, Tuple[Layout, LastUpdate]] = {}
        # per parameter key: positions within the parameter and values, not yet placed in a bucket
        self._pending: Dict[int, Entries] = {}

    def get(self, bucket_index: int, layout: Layout, device: torch.device) -> Optional[LastUpdate]:
        """The bucket's last update in this layout, on ``device``, or ``None`` if it received none."""
        stored = self._by_bucket.get(bucket_index)
        if stored is not None and stored[0] == layout:
            return stored[1]
        if stored is not None:  # a rebuild: every bucket's entries go back to their parameters
            self._unplace_all()
        positions, values = [], []
        for key, offset, _ in layout:
            entry = self._pending.pop(key, None)
            if entry is not None:
                positions.append(entry[0].to(device) + offset)
                values.append(entry[1].to(device))
        if not positions:
            return None
        return torch.cat(positions), torch.cat(values), False

    def put(self, bucket_index: int, layout: Layout, positions: torch.Tensor, values: torch.Tensor,
            whole: bool = False) -> None:
        """Record the bucket's update of this step: distinct positions (``whole``: every one, in order), values."""
        self._by_bucket[bucket_index] = (layout, (positions, values, whole))

    def drop_buckets_after(self, last_index: int) -> None:
        """Give the entries of bucket indices past the step's last bucket back to their parameters."""
        for index in [i for i in self._by_bucket if i > last_index]:
            self._unplace(index)

    def clear(self) -> None:
        self._by_bucket.clear()
        self._pending.clear()

    def _unplace_all(self) -> None:
        for index in list(self._by_bucket):
            self._unplace(index)

    def _unplace(self, bucket_index: int) -> None:
        # (reads on the host: it runs at a bucket rebuild and at a save, never in the steady state)
        layout, (positions, values, _) = self._by_bucket.pop(bucket_index)
        if not positions.numel():
            return
        # (a position's repeats, which hold 0, stay: the count of entries is then the same on every rank of a
        # node, whose shards all have pieces of the same sizes, and the node gathers them at once)
        starts = torch.tensor([offset for _, offset, _ in layout], dtype=torch.int64, device=positions.device)
        owner = owners(starts, positions, positions.numel(), whole=False)
        for i, (key, offset, _) in enumerate(layout):
            mine = owner == i
            if bool(mine.any()):
                self._pending[key] = (positions[mine] - offset, values[mine])

    def state(self) -> Dict[str, Dict[int, torch.Tensor]]:
        """Per parameter key, positions within the parameter and values (copies, on the CPU)."""
        self._unplace_all()
        out = {"positions": {}, "values": {}}
        for key in sorted(self._pending):
            positions, values = self._pending[key]
            out["positions"][key] = positions.detach().cpu().clone()
            out["values"][key] = values.detach().cpu().clone()
        return out

    def load(self, state: Dict[str, Dict[int, torch.Tensor]]) -> None:
        """Replace everything with a :meth:`state`; entries are placed when their parameters' buckets arrive."""
        self.clear()
        positions, values = state.get("positions", {}), state.get("values", {})
        if set(positions) != set(values):
            raise ValueError("the hook state's last update holds positions and values for different parameters: "
                             "it was not written by SparsifyState.state_dict()")
        for key in positions:
            p, v = positions[key].reshape(-1).long(), values[key].reshape(-1).float()
            if p.numel() != v.numel():
                raise ValueError(f"the hook state's last update of parameter #{key} has {p.numel()} positions but "
                                 f"{v.numel()} values: it was not written by SparsifyState.state_dict()")
            self._pending[int(key)] = (p, v)

    @property
    def pending_keys(self):
        return sorted(self._pending)


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
        """The bucket's result vector, or ``None`` where the result belongs in ``buffer`` itself.

        Only on the CPU, for float32 buckets whose gradients are not views of
        the bucket (``gradient_as_bucket_view=False``, DDP's default: DDP then
        copies the result into ``.grad`` in any case); on GPUs a zero fill is cheap.
        """
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


class ScratchMemory:
    """Per device, a float32 vector and a bool mask, grown on demand."""

    __slots__ = ("_by_device",)

    def __init__(self) -> None:
        self._by_device: Dict[torch.device, Tuple[torch.Tensor, torch.Tensor]] = {}

    def take(self, numel: int, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        """A float32 vector of ``numel`` and a bool mask of ``numel`` rounded up to 8 (contents undefined)."""
        floats, mask = self._by_device.get(device, (None, None))
        if floats is None or floats.numel() < numel:
            floats = torch.empty(numel, dtype=torch.float32, device=device)
            mask = torch.empty((numel + 7) // 8 * 8, dtype=torch.bool, device=device)
            self._by_device[device] = (floats, mask)
        return floats[:numel], mask


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

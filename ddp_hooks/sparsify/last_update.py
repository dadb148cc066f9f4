r"""The averaged update each bucket received at the last step, kept sparse and keyed by parameter.

With the optimizer's momentum counted in sends (:class:`~ddp_hooks.SparsifyState`,
``optimizer_momentum="sends"``) the hook returns ``u_t - m u_{t-1}``, where
``u_t`` is this step's averaged sent velocity, so that the optimizer's own
buffer ``m buf + grad`` holds exactly ``u_t``. ``u_{t-1}`` is zero except
where some rank sent at the last step: this store keeps those positions and
values per bucket, O(k) memory and work, not a dense copy of the model.

Like the residuals (:mod:`ddp_hooks.sparsify.residuals`) it follows its parameters
when DDP rebuilds its buckets: a bucket index that comes back with another
layout takes its entries parameter by parameter from wherever they were, and
:meth:`LastUpdates.state` saves them per parameter key, so a checkpoint
resumes on DDP's initial buckets.

Example::

    >>> import torch
    >>> store = LastUpdates()
    >>> store.put(0, ((0, 0, 4), (1, 4, 4)), torch.tensor([1, 6]), torch.tensor([0.5, -2.0]))
    >>> last = store.get(0, ((0, 0, 4), (1, 4, 4)), torch.device("cpu"))
    >>> last.positions.tolist(), last.values.tolist(), last.whole
    ([1, 6], [0.5, -2.0], False)
    >>> # after a rebuild parameter 1 comes first in bucket 0: its entry follows it
    >>> last = store.get(0, ((1, 0, 4),), torch.device("cpu"))
    >>> last.positions.tolist(), last.values.tolist()
    ([2], [-2.0])
"""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Tuple

import torch

from .layout import Layout
from .positions import gather, owners

__all__ = ["LastUpdates", "LastUpdate", "UpdateRecord", "present_update"]

Entries = Tuple[torch.Tensor, torch.Tensor]  # (int64 positions, float32 values)


class LastUpdate(NamedTuple):
    """A bucket's last averaged update: distinct positions, their values, and whether they are every position."""

    positions: torch.Tensor  # int64
    values: torch.Tensor  # float32
    whole: bool = False  # positions are 0 .. n-1 of the bucket, in order (.positions)


class LastUpdates:
    """Per bucket, the positions and values of the last averaged update, following parameters across rebuilds."""

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
        return LastUpdate(torch.cat(positions), torch.cat(values))

    def put(self, bucket_index: int, layout: Layout, positions: torch.Tensor, values: torch.Tensor,
            whole: bool = False) -> None:
        """Record the bucket's update of this step: distinct positions (``whole``: every one, in order), values."""
        self._by_bucket[bucket_index] = (layout, LastUpdate(positions, values, whole))

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
        layout, (positions, values, _) = self._by_bucket.pop(bucket_index)
        if not positions.numel():
            return
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


class UpdateRecord(NamedTuple):
    """Where a flight's averaged update is remembered, and the optimizer momentum that multiplies it next."""

    bucket: int  # bucket index (or GLOBAL_BUCKET)
    layout: tuple
    starts: torch.Tensor  # offsets where the layout's parameters start
    momentum: object  # float, or float32 tensor with one per parameter of the layout


def present_update(store: LastUpdates, record: UpdateRecord, target: torch.Tensor, written: List[torch.Tensor],
                   scale: Optional[torch.Tensor], inv_scale: Optional[torch.Tensor],
                   whole: bool = False) -> List[torch.Tensor]:
    """Turn the averaged update ``u_t`` in ``target`` into ``u_t - m u_{t-1}``; remember ``u_t``.

    The optimizer's buffer then steps to ``m (u_{t-1} + z) + u_t - m u_{t-1}
    = u_t + m z``: it holds this step's sent velocity (plus the momentum of
    whatever else it was given, weight decay), whatever it held from the
    sends before. Returns every position now written in ``target``. ``whole``:
    the one tensor in ``written`` is every position of ``target``, in order.
    """
    whole = whole and len(written) == 1
    positions = written[0] if len(written) == 1 else torch.cat(written).unique()  # AllGather: ranks overlap
    values = gather(target, positions, whole).float()
    if values is target:  # sent whole: a copy, as target changes below
        values = values.clone()
    previous = store.get(record.bucket, record.layout, target.device)
    m = record.momentum
    if previous is not None and (isinstance(m, torch.Tensor) or m != 0.0):
        where, before, was_whole = previous
        if isinstance(m, torch.Tensor):
            factor = m.index_select(0, owners(record.starts, where, target.numel(), was_whole)).neg_()
        else:
            factor = torch.full((), -float(m), device=target.device)
        if scale is not None:
            factor = factor * scale
        change = (before * factor).to(target.dtype)
        if was_whole:
            target.add_(change)
        else:
            target.index_add_(0, where, change)
        written = [positions, where]
    store.put(record.bucket, record.layout, positions, values if inv_scale is None else values * inv_scale, whole)
    return written

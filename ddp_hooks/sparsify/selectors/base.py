"""The selector seam: what a coordinate selector C_k is, and what it tells the exchange.

A *unit* is a contiguous range ``[offset, offset + numel)`` of a flat vector
(a layer inside a bucket, a whole bucket, or every bucket of a step). Each
unit gets a budget ``k = ceil(density * numel)`` and a selector returns the
absolute positions of the ``k`` coordinates it keeps, unit by unit.

A selector is a subclass of :class:`Selector` that states, as class
attributes, what the exchange of :func:`~ddp_hooks.sparsify_hook` needs to
know (so the exchange never compares names):

* ``aggregations``: the aggregations it allows. ``"allreduce"`` needs every
  rank to choose the same positions; ``"allgather"`` lets each rank choose
  its own.
* ``positions_travel``: under AllGather each rank's positions are sent with
  its values (top-k); otherwise every rank recomputes every other rank's
  positions from ``(seed, step, unit, rank)``, and only values travel.
* ``reads_values``: it chooses from ``|p|``, the magnitude of the
  compensated gradient (top-k); the others only need the units.
* ``leaves_at_random_times``: a coordinate leaves whatever its size, about
  once every ``1 / density`` steps with all it gathered; the optimizer's
  momentum applied per step multiplies those bursts and is warned about
  (:func:`~ddp_hooks.check_optimizer`).
* ``code``: the int a checkpoint stores for it; never reused, so adding or
  reordering selectors cannot change what a saved state means.
* ``communicates``: it agrees on positions through collectives of its own
  (shared top-k). Its :meth:`Selector.begin` may leave them in flight: the
  hook starts the next bucket's selection before it waits for them, so a
  rank does not stand idle in the hook while the other ranks catch up.

Adding a selector is one file with its subclass and one line in
:mod:`.registry` (or a call to :func:`~.registry.register_selector`).

Example (a selector is deterministic in its request)::

    >>> import torch
    >>> from ddp_hooks.sparsify.selectors import SelectionRequest, Unit, budget, selector_for
    >>> p = torch.tensor([0.1, -3.0, 0.2, 2.0, 0.0, 0.5])
    >>> units = (Unit(key=0, offset=0, numel=3), Unit(key=1, offset=3, numel=3))
    >>> [budget(u.numel, 0.34) for u in units]
    [2, 2]
    >>> request = SelectionRequest(units=units, density=0.34, seed=0, step=0, magnitude=p.abs())
    >>> sorted(selector_for("topk").select(request).tolist())
    [1, 2, 3, 5]
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any, Callable, ClassVar, NamedTuple, Optional, Sequence, Tuple

import torch

from .draws import SHARED

__all__ = ["Unit", "budget", "budgets", "total_budget", "SelectionRequest", "Choice", "Selector"]


class Unit(NamedTuple):
    """A contiguous range of the flat vector that gets its own budget."""

    key: int  # identifies the unit for seeding: parameter key, bucket index, or 0
    offset: int
    numel: int


def budget(numel: int, density: float) -> int:
    """``ceil(density * numel)``, at least 1, at most ``numel``.

    The product is rounded to 6 decimals first so that float noise
    (``0.07 * 100 == 7.000000000000001``) does not add a coordinate.
    """
    return min(numel, max(1, math.ceil(round(density * numel, 6))))


@lru_cache(maxsize=1024)
def budgets(units: Tuple[Unit, ...], density: float) -> Tuple[int, ...]:
    """Each unit's budget; cached, as a bucket's units repeat every step."""
    return tuple(budget(u.numel, density) for u in units)


def total_budget(units, density: float) -> int:
    """The entries a rank sends for these units: the sum of their budgets."""
    return sum(budgets(tuple(units), density))


class SelectionRequest(NamedTuple):
    """Everything a selector may use to choose one step's positions of some units."""

    units: Tuple[Unit, ...]
    density: float  # this step's density (the warm-up may make it larger than the option)
    seed: int
    step: int
    rank: int = SHARED  # whose choice: SHARED (-1) when all ranks choose alike (AllReduce), else that rank
    magnitude: Optional[torch.Tensor] = None  # |p|, the flat compensated gradient's magnitude (reads_values)
    device: Optional[torch.device] = None  # where the positions are made (default: the magnitude's)
    scratch_mask: Optional[torch.Tensor] = None  # bool memory a selector may reuse, numel rounded up to 8
    group: Any = None  # the process group, for a selector that agrees on positions by communicating
    world_size: int = 1
    host_reads: Optional[bool] = None  # may read tensors on the host (a sync); None: only on the CPU

    @property
    def where(self) -> torch.device:
        return self.device if self.device is not None else self.magnitude.device

    @property
    def reads_on_host(self) -> bool:
        """Whether the selector may read tensors on the host: free on the CPU, a stall of the stream elsewhere."""
        return self.where.type == "cpu" if self.host_reads is None else self.host_reads


class Choice:
    """Positions being chosen: ready, or waiting for a selector's own collectives; :meth:`wait` gives them.

    Example::

        >>> import torch
        >>> Choice.ready(torch.tensor([3, 5])).wait().tolist()
        [3, 5]
        >>> later = Choice.joined([Choice.ready(torch.tensor([1])), Choice(lambda: torch.tensor([7, 9]))])
        >>> later.waits, later.wait().tolist(), later.waits
        (True, [1, 7, 9], False)
    """

    __slots__ = ("_positions", "_finish")

    def __init__(self, finish: Optional[Callable[[], torch.Tensor]] = None, *,
                 positions: Optional[torch.Tensor] = None) -> None:
        if (finish is None) == (positions is None):
            raise TypeError("Choice takes exactly one of `finish` (waits for the collectives and returns the "
                            "positions) and `positions` (already chosen)")
        self._positions = positions
        self._finish = finish

    @classmethod
    def ready(cls, positions: torch.Tensor) -> "Choice":
        """Positions already chosen: :meth:`wait` returns them at once."""
        return cls(positions=positions)

    @classmethod
    def joined(cls, parts: Sequence["Choice"]) -> "Choice":
        """The parts' positions end to end; waiting only if some part waits."""
        if not any(part.waits for part in parts):
            return cls.ready(torch.cat([part.wait() for part in parts]))
        return cls(lambda: torch.cat([part.wait() for part in parts]))

    @property
    def waits(self) -> bool:
        """True while the positions depend on collectives not yet waited for."""
        return self._finish is not None

    def wait(self) -> torch.Tensor:
        """The positions (int64, 1-D), once the collectives they need have finished."""
        if self._finish is not None:
            self._positions, self._finish = self._finish(), None
        return self._positions


class Selector:
    """Base of the coordinate selectors: class attributes for the exchange, :meth:`choose` for the work.

    Subclasses set the class attributes (see the module docstring) and
    implement :meth:`choose` (or :meth:`begin`, to leave collectives in
    flight); :meth:`start` and :meth:`select` handle what is common to all:
    a request whose budgets cover every unit sends everything, in order (so
    ``density=1`` reproduces a plain allreduce bit for bit), and units out of
    position order are chosen one at a time.
    """

    name: ClassVar[str]
    code: ClassVar[int]
    aggregations: ClassVar[Tuple[str, ...]] = ("allreduce", "allgather")
    #: why the aggregations left out are refused (named in the error)
    aggregation_reason: ClassVar[str] = ""
    positions_travel: ClassVar[bool] = False
    #: it runs collectives of its own to agree on positions (their bytes: :meth:`agreement_bytes`)
    communicates: ClassVar[bool] = False
    reads_values: ClassVar[bool] = False
    leaves_at_random_times: ClassVar[bool] = False
    #: the options of its own that :meth:`from_options` reads (``block_size``): a checkpoint's other
    #: selectors' options cannot matter to it, so loading ignores them
    own_options: ClassVar[Tuple[str, ...]] = ()

    @classmethod
    def from_options(cls, options) -> "Selector":
        """The selector for a :class:`~ddp_hooks.sparsify.options.SparsifyOptions`; override to read its own options."""
        return cls()

    def select(self, request: SelectionRequest) -> torch.Tensor:
        """Positions (int64, 1-D): the concatenation over units of each unit's ``budget`` positions."""
        return self.start(request).wait()

    def start(self, request: SelectionRequest) -> Choice:
        """:meth:`select`, with the selector's own collectives (if any) left in flight until ``wait()``."""
        parts = [self.begin(part, ks) if ks is not None
                 else Choice.ready(torch.cat([torch.arange(u.offset, u.offset + u.numel, device=part.where)
                                              for u in part.units]))
                 for part, ks in self._parts(request)]
        return parts[0] if len(parts) == 1 else Choice.joined(parts)

    def begin(self, request: SelectionRequest, ks: Tuple[int, ...]) -> Choice:
        """:meth:`choose` as a :class:`Choice`. A selector that ``communicates`` overrides it to leave its
        collectives in flight; it must be done with ``request.magnitude`` and ``request.scratch_mask`` when
        it returns (the next bucket reuses them)."""
        return Choice.ready(self.choose(request, ks))

    def agreement_bytes(self, request: SelectionRequest) -> int:
        """The bytes :meth:`select` hands to collectives of the selector's own for ``request`` (the stats count them)."""
        return sum(self.selection_bytes(part, ks) for part, ks in self._parts(request) if ks is not None)

    def _parts(self, request: SelectionRequest):
        """The request as :meth:`choose` takes it: ``(request, budgets)`` pairs, units ascending; budgets ``None``
        for a request whose budgets cover every unit (density 1: everything is sent, in order)."""
        units = request.units
        if not isinstance(units, tuple):
            units = tuple(units)
            request = request._replace(units=units)
        ks = budgets(units, request.density)
        if all(k == u.numel for u, k in zip(units, ks)):
            yield request, None
        elif not _ascending(units):
            for u in units:
                yield from self._parts(request._replace(units=(u,)))
        else:
            yield request, ks

    def choose(self, request: SelectionRequest, ks: Tuple[int, ...]) -> torch.Tensor:
        """Positions for units in increasing position order, ``ks`` their budgets (some below their unit)."""
        raise NotImplementedError

    def selection_bytes(self, request: SelectionRequest, ks: Tuple[int, ...]) -> int:
        """For :meth:`agreement_bytes`, as :meth:`choose` is for :meth:`select` (0: no collective of its own)."""
        return 0


def _ascending(units) -> bool:
    return all(a.offset + a.numel <= b.offset for a, b in zip(units, units[1:]))

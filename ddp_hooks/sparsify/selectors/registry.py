"""The registry of selectors: names for ``SparsifyState(method=...)``, codes for checkpoints.

The built-in selectors are listed once, in :data:`BUILT_IN`; a selector of
one's own is added with :func:`register_selector`, which refuses a name or a
checkpoint code already taken by another class (a code must never be reused:
checkpoints store it) and a combination the exchange cannot serve.

Example (a selector that keeps the first ``k`` entries of each unit; after
``register_selector(FirstK)``, ``SparsifyState(method="first_k")`` uses it,
and ``tests/sparsify/test_selector_seam.py`` runs it through the hook)::

    >>> import torch
    >>> from ddp_hooks.sparsify.selectors import SelectionRequest, Selector, Unit
    >>> class FirstK(Selector):
    ...     name, code = "first_k", 1000
    ...     def choose(self, request, ks):
    ...         return torch.cat([torch.arange(u.offset, u.offset + k) for u, k in zip(request.units, ks)])
    >>> FirstK().select(SelectionRequest(units=(Unit(0, 0, 10),), density=0.3, seed=0, step=0,
    ...                                  device=torch.device("cpu"))).tolist()
    [0, 1, 2]
"""

from __future__ import annotations

from typing import Dict, Tuple, Type

import torch

from .base import SelectionRequest, Selector, Unit  # noqa: F401 (Unit: the docstring examples use it)
from .draws import SHARED
from .random_block import RandomBlock
from .randomk import RandomK
from .shared_topk import SharedTopK
from .topk import TopK

__all__ = ["BUILT_IN", "register_selector", "selector_class", "selector_names", "selector_by_code", "selector_for",
           "select"]

AGGREGATIONS = ("allreduce", "allgather")

#: The selectors every SparsifyState knows, in the order their names are listed in errors.
BUILT_IN: Tuple[Type[Selector], ...] = (TopK, RandomK, RandomBlock, SharedTopK)

_BY_NAME: Dict[str, Type[Selector]] = {}
_BY_CODE: Dict[int, Type[Selector]] = {}


def register_selector(cls: Type[Selector]) -> Type[Selector]:
    """Make ``cls`` available as ``SparsifyState(method=cls.name)``; returns ``cls`` (usable as a decorator).

    A selector whose ``from_options`` reads an option of ``SparsifyState``
    that only some selectors use (``block_size``) names it in its
    ``own_options``: loading a checkpoint compares it only then.

    Registering the same class again is a no-op (a module imported twice, a
    spawned process).

    Raises:
        TypeError: ``cls`` is not a :class:`Selector` subclass.
        ValueError: its name or code belongs to another selector, its
            aggregations are not a non-empty subset of ``("allreduce",
            "allgather")``, or it reads values under AllGather without sending
            its positions (the other ranks could not recompute them).
    """
    if not (isinstance(cls, type) and issubclass(cls, Selector)) or cls is Selector:
        raise TypeError(f"`cls` must be a subclass of ddp_hooks.sparsify.selectors.Selector, got {cls!r}")
    name, code = getattr(cls, "name", None), getattr(cls, "code", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"selector {cls.__name__} must set `name` to a non-empty str, got {name!r}; "
                         "it is what SparsifyState(method=...) accepts")
    if isinstance(code, bool) or not isinstance(code, int) or code < 0:
        raise ValueError(f"selector {cls.__name__} must set `code` to an int >= 0, got {code!r}; checkpoints "
                         "store it in place of the name")
    for table, value, what in ((_BY_NAME, name, "name"), (_BY_CODE, code, "code")):
        taken = table.get(value)
        if taken is not None and (taken.__module__, taken.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ValueError(f"selector {cls.__name__}: {what} {value!r} is taken by {taken.__name__}; {what}s "
                             "must be unique, and a code is never reused, so that a checkpoint means one thing")
    if not cls.aggregations or any(a not in AGGREGATIONS for a in cls.aggregations):
        raise ValueError(f"selector {cls.__name__} must allow a non-empty subset of {AGGREGATIONS}, got "
                         f"{cls.aggregations!r}")
    if "allgather" in cls.aggregations and cls.reads_values and not cls.positions_travel:
        raise ValueError(f"selector {cls.__name__} reads values under AllGather but does not send its positions: "
                         "the other ranks cannot recompute a choice made from values they do not have; set "
                         "positions_travel = True")
    _BY_NAME[name] = _BY_CODE[code] = cls
    return cls


for _cls in BUILT_IN:
    register_selector(_cls)


def selector_names() -> Tuple[str, ...]:
    """The names ``SparsifyState(method=...)`` accepts."""
    return tuple(_BY_NAME)


def selector_class(name: str) -> Type[Selector]:
    """The selector registered as ``name`` (``KeyError`` if none)."""
    return _BY_NAME[name]


def selector_by_code(code: int) -> Type[Selector]:
    """The selector a checkpoint's code stands for (``KeyError`` if none)."""
    return _BY_CODE[code]


def selector_for(name: str, **options) -> Selector:
    """An instance of the selector registered as ``name``, built with its own ``options`` (``block_size``)."""
    return selector_class(name)(**options)


def select(method: str, values: torch.Tensor, units, density: float, seed: int = 0, step: int = 0,
           rank: int = SHARED, **options) -> torch.Tensor:
    """Positions (int64, 1-D, on ``values.device``) kept by ``method`` in each unit, unit by unit.

    A convenience for tests and benchmarks: ``values`` is the flat
    compensated vector ``p`` (only selectors that read values look at it);
    ``rank`` is ``SHARED`` (-1) when all ranks must choose alike, else the
    rank whose choice this is; ``options`` go to the selector
    (``block_size=`` for ``"random_block"``).

    Example::

        >>> import torch
        >>> p = torch.tensor([0.1, -3.0, 0.2, 2.0, 0.0, 0.5])
        >>> sorted(select("topk", p, [Unit(0, 0, 3), Unit(1, 3, 3)], 0.34).tolist())
        [1, 2, 3, 5]
    """
    request = SelectionRequest(units=tuple(units), density=density, seed=seed, step=step, rank=rank,
                               magnitude=values.abs(), device=values.device)
    return selector_for(method, **options).select(request)

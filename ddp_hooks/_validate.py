"""Argument checks shared by the package's constructors.

Each check raises with the argument's name, the value received, the rule, and
why the rule exists, e.g.::

    ValueError: `density` must be a float in (0, 1], got 1.5; it is the fraction
    of gradient entries each rank sends per step
"""

from __future__ import annotations

import math
from typing import Iterable


def _why(reason: str) -> str:
    return f"; {reason}" if reason else ""


def check_choice(name: str, value, choices: Iterable[str], reason: str = "") -> str:
    choices = tuple(choices)
    if not isinstance(value, str) or value not in choices:
        raise ValueError(
            f"`{name}` must be one of {', '.join(repr(c) for c in choices)}, got {value!r}{_why(reason)}"
        )
    return value


def check_bool(name: str, value, reason: str = "") -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be a bool, got {value!r} of type {type(value).__name__}{_why(reason)}")
    return value


def check_int(name: str, value, minimum: int, reason: str = "", maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`{name}` must be an int, got {value!r} of type {type(value).__name__}{_why(reason)}")
    if value < minimum or (maximum is not None and value > maximum):
        rule = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"`{name}` must be an int {rule}, got {value}{_why(reason)}")
    return value


def check_float(
    name: str,
    value,
    low: float,
    high: float,
    low_open: bool = False,
    high_open: bool = False,
    reason: str = "",
) -> float:
    """Check low (<|<=) value (<|<=) high; ints are accepted, bools and NaN are not."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"`{name}` must be a float, got {value!r} of type {type(value).__name__}{_why(reason)}")
    value = float(value)
    too_low = value <= low if low_open else value < low
    too_high = value >= high if high_open else value > high
    if math.isnan(value) or too_low or too_high:
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise ValueError(f"`{name}` must be a float in {interval}, got {value!r}{_why(reason)}")
    return value


def check_process_group(name: str, value) -> None:
    """None (the default group) or a ``torch.distributed.ProcessGroup``."""
    if value is None:
        return
    import torch.distributed as dist

    if not isinstance(value, dist.ProcessGroup):
        raise TypeError(
            f"`{name}` must be None (the default group) or a torch.distributed.ProcessGroup, "
            f"got {value!r} of type {type(value).__name__}"
        )

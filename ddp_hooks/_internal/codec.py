"""Settings as int64 and back: floats travel as their IEEE-754 bits, so nothing is rounded.

One codec for the checkpoints (a float option saved as an int cannot be rounded on
resume) and for the cross-rank agreement check (0.1 and 0.1000001 differ).

Example::

    >>> float_to_bits(0.1) == float_to_bits(0.1), bits_to_float(float_to_bits(0.1))
    (True, 0.1)
    >>> setting_to_int64(True), int64_to_setting(1, like=True), int64_to_setting(7, like=3)
    (1, True, 7)
"""

from __future__ import annotations

import struct
from typing import Union

__all__ = ["Setting", "float_to_bits", "bits_to_float", "setting_to_int64", "int64_to_setting"]

Setting = Union[int, float, bool]


def float_to_bits(x: float) -> int:
    """The IEEE-754 bits of a double as a signed int64 (fits a checkpoint's ints and an int64 tensor)."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def bits_to_float(bits: int) -> float:
    """The double whose IEEE-754 bits are the int64 ``bits``."""
    return struct.unpack("<d", struct.pack("<q", bits))[0]


def setting_to_int64(value: Setting) -> int:
    """An int or bool as itself, a float as its bits."""
    return float_to_bits(value) if isinstance(value, float) else int(value)


def int64_to_setting(code: int, like: Setting) -> Setting:
    """The inverse of :func:`setting_to_int64` for a setting of the type of ``like``."""
    if isinstance(like, float):
        return bits_to_float(code)
    return bool(code) if isinstance(like, bool) else code

"""Deterministic seeds for coordinate selection, derived without any global RNG.

A random selector's choice at a step is a pure function of
``(seed, step, unit, rank)``: every rank can compute every other rank's
choice without communication, a resumed run draws exactly what the
uninterrupted run drew, and the user's ``torch.manual_seed`` stream is never
touched (GRACE's RandomK reseeds the global RNG; we do not).

The mixer is SplitMix64 (Steele, Lea, Flood, 2014), applied to each input in
turn, so nearby inputs give unrelated seeds.

Example::

    >>> from ddp_hooks._internal.seeding import derive_seed
    >>> derive_seed(0, 5, 3) == derive_seed(0, 5, 3)
    True
    >>> derive_seed(0, 5, 3) != derive_seed(0, 6, 3)
    True
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1

#: Value of ``rank`` for choices shared by all ranks (AllReduce aggregation).
SHARED = -1


def splitmix64(x: int) -> int:
    """One SplitMix64 step of a 64-bit int (Python ints, masked to 64 bits)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def derive_seed(seed: int, step: int, unit: int, rank: int = SHARED) -> int:
    """Return a 64-bit value mixing ``(seed, step, unit, rank)``.

    Args:
        seed (int): the user's seed.
        step (int): the optimizer step (the hook's counter).
        unit (int): the unit of selection: a parameter's key (layer scope), a
            bucket index (bucket scope), or 0 (global scope).
        rank (int): the rank for rank-specific choices, or ``SHARED`` (-1).
    """
    h = splitmix64(seed & _MASK64)
    for part in (step, unit, rank):
        h = splitmix64(h ^ (part & _MASK64))
    return h


def to_signed(x: int) -> int:
    """A 64-bit pattern as the int64 value torch stores for it."""
    return x - (1 << 64) if x >= (1 << 63) else x


#: The SplitMix64 increment as an int64 (the stride between a stream's draws).
GAMMA = to_signed(0x9E3779B97F4A7C15)
_MUL1 = to_signed(0xBF58476D1CE4E5B9)
_MUL2 = to_signed(0x94D049BB133111EB)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's ``>>`` is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def splitmix64_tensor(x: torch.Tensor) -> torch.Tensor:
    """:func:`derive_seed`'s mixer applied elementwise to an int64 tensor (bit patterns, mod 2**64).

    Equal bit for bit to the Python version (``tests/test_sparsify_unit.py``
    checks it), on any device: it is what lets every coordinate of a random
    selection be a pure function of ``(seed, step, unit, rank, counter)``
    computed in a few vectorised integer operations, with no generator per
    unit. Multiplication wraps modulo 2**64, as two's-complement int64 does.

    Example::

        >>> import torch
        >>> x = torch.tensor([0, 1, 2**40])
        >>> splitmix64_tensor(x).tolist() == [to_signed(splitmix64(v)) for v in (0, 1, 2**40)]
        True
    """
    x = x + GAMMA
    shifted = torch.empty_like(x)  # the rounds run in place: two buffers, not one per operation
    for bits, multiplier in ((30, _MUL1), (27, _MUL2), (31, None)):
        torch.bitwise_right_shift(x, bits, out=shifted).bitwise_and_((1 << (64 - bits)) - 1)  # logical shift
        x.bitwise_xor_(shifted)
        if multiplier is not None:
            x.mul_(multiplier)
    return x


def derive_seeds(seed: int, step: int, units: torch.Tensor, rank: int = SHARED) -> torch.Tensor:
    """:func:`derive_seed` for a tensor of unit keys at once, as int64 bit patterns, on ``units.device``.

    Only ``seed`` and ``step`` are mixed on the host; the rest runs on the
    device, so no tensor is copied between host and device.

    Example::

        >>> import torch
        >>> got = derive_seeds(7, 3, torch.tensor([0, 5]), rank=2).tolist()
        >>> got == [to_signed(derive_seed(7, 3, u, 2)) for u in (0, 5)]
        True
    """
    h = splitmix64(splitmix64(seed & _MASK64) ^ (step & _MASK64))
    h = splitmix64_tensor(units ^ to_signed(h))
    return splitmix64_tensor(h ^ to_signed(rank & _MASK64))


def uniform_below(bits: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """Map 64-bit hashes to integers in ``[0, bound)`` (bias below ``bound / 2**63``)."""
    return _shift_right(bits, 1) % bound


def generator_for(seed64: int, device: torch.device) -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded from a :func:`derive_seed` value.

    The generator lives on the gradient's device so indices are drawn where
    they are used (no host-to-device copy in the hot path on CUDA).
    """
    gen = torch.Generator(device=device)
    gen.manual_seed(seed64 & ((1 << 63) - 1))
    return gen

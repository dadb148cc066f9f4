"""Deterministic seeds for coordinate selection, derived without any global RNG.

A random selector's choice at a step is a pure function of
``(seed, step, unit, rank)``: every rank can compute every other rank's
choice without communication, a resumed run draws exactly what the
uninterrupted run drew, and the user's ``torch.manual_seed`` stream is never
touched (GRACE's RandomK reseeds the global RNG; we do not).

The mixer is SplitMix64 (Steele, Lea, Flood, 2014), applied to each input in
turn, so nearby inputs give unrelated seeds.

Example::

    >>> from ddp_hooks.seeding import derive_seed
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


def _splitmix64(x: int) -> int:
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
    h = _splitmix64(seed & _MASK64)
    for part in (step, unit, rank):
        h = _splitmix64(h ^ (part & _MASK64))
    return h


def generator_for(seed64: int, device: torch.device) -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded from a :func:`derive_seed` value.

    The generator lives on the gradient's device so indices are drawn where
    they are used (no host-to-device copy in the hot path on CUDA).
    """
    gen = torch.Generator(device=device)
    gen.manual_seed(seed64 & ((1 << 63) - 1))
    return gen

"""Memory the hook reuses from step to step: top-k's ``|p|`` and its candidate mask.

A fresh 25 MB allocation per bucket and step costs page faults on the CPU;
this keeps one float32 vector and one bool mask per device, grown to the
largest unit of work seen.

Example::

    >>> import torch
    >>> scratch = ScratchMemory()
    >>> floats, mask = scratch.take(10, torch.device("cpu"))
    >>> floats.numel(), mask.numel()
    (10, 16)
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch

__all__ = ["ScratchMemory"]


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

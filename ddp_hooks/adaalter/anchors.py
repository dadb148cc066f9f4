"""The anchor of local SGD: the parameters every rank shared when a round began, saved and restored with them.

An outer optimizer and a sparse synchronisation both step from the anchor,
and both keep it in their checkpoints as a list of tensors (empty before the
first round). These two helpers check a saved list against the parameters
and restore it on their devices and dtypes.

Example::

    >>> import torch
    >>> like = [torch.zeros(2, 3)]
    >>> check_anchors([torch.ones(2, 3)], like, "outer-optimizer")
    >>> restored_anchors([torch.ones(2, 3)], like)[0].shape, restored_anchors([], like)
    (torch.Size([2, 3]), None)
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

__all__ = ["check_anchors", "restored_anchors"]


def check_anchors(saved: Sequence[torch.Tensor], like: Sequence[torch.Tensor], what: str) -> None:
    """``ValueError`` unless ``saved`` is empty or shaped like ``like`` (the parameters), one for one."""
    if saved and (len(saved) != len(like) or any(a.shape != p.shape for a, p in zip(saved, like))):
        raise ValueError(f"the checkpoint's {what} anchors do not match the parameters' shapes: it was saved from "
                         "a different model")


def restored_anchors(saved: Sequence[torch.Tensor], like: Sequence[torch.Tensor]) -> Optional[List[torch.Tensor]]:
    """Copies of ``saved`` on the devices and in the dtypes of ``like``; ``None`` where nothing was saved."""
    if not saved:
        return None
    return [a.to(device=p.device, dtype=p.dtype).clone() for a, p in zip(saved, like)]

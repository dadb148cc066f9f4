"""Future-returning collectives used by the hooks, the group's size and rank, and cross-rank agreement.

All of them average by dividing *before* the collective, as PyTorch's
``allreduce_hook`` does, so half-precision sums cannot overflow.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from .codec import Setting, int64_to_setting, setting_to_int64


def world_size_and_rank(group=None) -> Tuple[int, int]:
    """The group's size and this process's rank in it; ``(1, 0)`` without torch.distributed (one process)."""
    if not dist.is_available() or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def completed_future(value) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


def _then_return(fut: torch.futures.Future, value) -> torch.futures.Future:
    """``fut.then(...)`` holding ``value``, failing if ``fut`` failed.

    A callback that does not read ``f.value()`` completes successfully even
    when the collective failed (a timeout, a dead peer), and would hand an
    unreduced or uninitialised tensor on as if it were the result.
    """
    def check(f):
        f.value()  # raises the collective's error
        return value

    return fut.then(check)


def allreduce_sum(tensor: torch.Tensor, group, world_size: int) -> torch.futures.Future:
    """Sum ``tensor`` in place across the group; the future holds ``tensor``."""
    if world_size == 1:
        return completed_future(tensor)
    return _then_return(dist.all_reduce(tensor, group=group, async_op=True).get_future(), tensor)


def allreduce_mean(tensor: torch.Tensor, group, world_size: int) -> torch.futures.Future:
    """Average ``tensor`` in place across the group; the future holds ``tensor``."""
    if world_size > 1:
        tensor.div_(world_size)
    return allreduce_sum(tensor, group, world_size)


def check_same_on_all_ranks(
    settings: Dict[str, Setting],
    group,
    world_size: int,
    device: torch.device,
    what: str,
    why: str,
    describe: Optional[Callable[[Dict[str, Setting]], str]] = None,
) -> None:
    """Raise the same ``ValueError`` on every rank unless all ranks hold equal ``settings``.

    The message names ``what``, rank 0's and the first differing rank's
    settings (``describe``, by default the settings that differ) and ``why``.

    One small blocking ``all_gather`` of an int64 vector (floats travel as
    their bit patterns). Call it at the same point on every rank, before the
    first collective whose shape or meaning depends on the settings, so that a
    mismatch ends in an error instead of a hang or averaged garbage. Every rank
    sees the same gathered rows, so every rank raises alike.

    Example (one process: nothing to compare)::

        >>> check_same_on_all_ranks({"period": 4}, None, 1, torch.device("cpu"), "options", "")
    """
    if world_size == 1:
        return
    names, values = list(settings), list(settings.values())
    mine = torch.tensor([setting_to_int64(v) for v in values], dtype=torch.int64, device=device)
    rows = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(rows, mine, group=group)
    for r, row in enumerate(rows):
        if not torch.equal(row, rows[0]):
            first, theirs = ({k: int64_to_setting(c, v) for k, c, v in zip(names, codes, values)}
                             for codes in (rows[0].tolist(), row.tolist()))
            if describe is None:  # name only the settings that differ
                differ = [k for k in names if first[k] != theirs[k]]
                describe = lambda s: ", ".join(f"{k}={s[k]!r}" for k in differ)  # noqa: E731
            raise ValueError(f"ranks were built with different {what}: rank 0 has {describe(first)} but "
                             f"rank {r} has {describe(theirs)}; {why}")

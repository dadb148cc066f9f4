"""Future-returning collectives used by the hooks.

All of them average by dividing *before* the collective, as PyTorch's
``allreduce_hook`` does, so half-precision sums cannot overflow.
"""

from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist


def completed_future(value) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


def allreduce_sum(tensor: torch.Tensor, group, world_size: int) -> torch.futures.Future:
    """Sum ``tensor`` in place across the group; the future holds ``tensor``."""
    if world_size == 1:
        return completed_future(tensor)
    fut = dist.all_reduce(tensor, group=group, async_op=True).get_future()
    return fut.then(lambda f: tensor)


def allreduce_mean(tensor: torch.Tensor, group, world_size: int) -> torch.futures.Future:
    """Average ``tensor`` in place across the group; the future holds ``tensor``."""
    if world_size > 1:
        tensor.div_(world_size)
    return allreduce_sum(tensor, group, world_size)


def _gather_into(output: torch.Tensor, tensor: torch.Tensor, group):
    # torch >= 2.14 names it all_gather_single; older releases all_gather_into_tensor.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, tensor, group=group, async_op=True)


def allgather(tensor: torch.Tensor, group, world_size: int) -> torch.futures.Future:
    """Gather equal-sized 1-D tensors; the future holds a ``(world_size, n)`` tensor."""
    if world_size == 1:
        return completed_future(tensor.unsqueeze(0))
    output = torch.empty(world_size * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    fut = _gather_into(output, tensor, group).get_future()
    return fut.then(lambda f: output.view(world_size, -1))


def allgather_many(tensors: List[torch.Tensor], group, world_size: int) -> torch.futures.Future:
    """Gather several 1-D tensors of one dtype in one collective (packed).

    The future holds a list: for each input, a ``(world_size, n_i)`` tensor.
    """
    sizes = [t.numel() for t in tensors]
    packed = tensors[0] if len(tensors) == 1 else torch.cat(tensors)

    def unpack(f):
        rows = f.value()
        return list(rows.split(sizes, dim=1))

    return allgather(packed, group, world_size).then(unpack)

"""Compare the replicas of a model across ranks (:func:`assert_replicas_equal`); see :mod:`ddp_hooks.testing`."""

from __future__ import annotations

__all__ = ["assert_replicas_equal"]


def assert_replicas_equal(module, process_group=None, atol: float = 0.0, rtol: float = 0.0) -> None:
    """Assert that every rank holds the same parameters and buffers as rank 0.

    Call it on every rank (it runs one ``all_gather`` per tensor); on a
    mismatch every rank raises the same ``AssertionError`` naming the first
    differing tensor, the rank and the largest difference. With the default
    tolerances the check is bitwise.

    Args:
        module (torch.nn.Module): the model (a DDP wrapper works too).
        process_group: the group to compare across (default: the world).
        atol, rtol (float): tolerances passed to ``torch.allclose``.
    """
    import torch
    import torch.distributed as dist

    world = dist.get_world_size(process_group)
    named = list(module.named_parameters()) + list(module.named_buffers())
    for name, tensor in named:
        local = tensor.detach().contiguous()
        gathered = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(gathered, local, group=process_group)
        ref = gathered[0]
        for r in range(1, world):
            other = gathered[r]
            same = torch.equal(ref, other) if atol == 0 and rtol == 0 else torch.allclose(
                ref, other, atol=atol, rtol=rtol, equal_nan=True
            )
            if not same:
                diff = (ref.double() - other.double()).abs().max().item() if ref.is_floating_point() else "n/a"
                raise AssertionError(
                    f"replicas differ: tensor {name!r} on rank {r} differs from rank 0 "
                    f"(max abs difference {diff}, atol={atol}, rtol={rtol})"
                )

"""A hook state whose ``state_dict`` holds every rank's, for checkpoints written by one process.

A sparsifying hook's residuals differ per rank (each holds what its own
gradients have not sent yet), and so do Local AdaAlter's between
averagings. Lightning and Accelerate build a checkpoint on every rank but
write it from rank 0 only (so does the Hugging Face Trainer's helper
here), so a hook state saved as ``state.state_dict()`` would keep rank 0's
residuals and drop the others'. :class:`EveryRankState`
wraps the hook state: its :meth:`~EveryRankState.state_dict` gathers every
rank's state (a collective: every rank must call it, as these frameworks
do), and :meth:`~EveryRankState.load_state_dict` gives each rank its own
back, so a resume is bitwise that of the uninterrupted run.

Cost: every rank holds all ``W`` states on the CPU while the checkpoint is
built (the residuals are each the size of the model's gradients).

Example (one process, so one state)::

    >>> from ddp_hooks import SparsifyState
    >>> from ddp_hooks.integrations import EveryRankState
    >>> saved = EveryRankState(SparsifyState(method="random_block", density=0.1)).state_dict()
    >>> saved["world_size"], len(saved["ranks"])
    (1, 1)
    >>> EveryRankState(SparsifyState(method="random_block", density=0.1)).load_state_dict(saved)
"""

from __future__ import annotations

from typing import Any, Dict

import torch
import torch.distributed as dist

from .._internal.collectives import world_size_and_rank

__all__ = ["EveryRankState", "check_hook", "ddp_inside", "gather_every_rank", "not_ddp_message", "own_entry"]


class EveryRankState:
    """``hook_state`` seen through a ``state_dict`` that holds every rank's state, in rank order.

    Args:
        hook_state: a hook state with ``state_dict()`` and
            ``load_state_dict(state)``: :class:`~ddp_hooks.SparsifyState`, the
            hook state of :func:`~ddp_hooks.build_local_adaalter`, or any other.
        group: the process group whose ranks save and load (default: the
            whole world).
    """

    def __init__(self, hook_state: Any, group=None):
        for name in ("state_dict", "load_state_dict"):
            if not callable(getattr(hook_state, name, None)):
                raise TypeError(f"`hook_state` must have a {name}() method (a hook state such as SparsifyState), "
                                f"got {type(hook_state).__name__}")
        self.hook_state = hook_state
        self.group = group

    def state_dict(self) -> Dict[str, Any]:
        """Every rank's ``hook_state.state_dict()``, tensors on the CPU; a collective: call it on every rank."""
        return gather_every_rank(self.hook_state.state_dict(), self.group)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load this rank's own entry of a :meth:`state_dict` saved at the same world size."""
        self.hook_state.load_state_dict(own_entry(state_dict, self.group))


def gather_every_rank(mine: Any, group=None) -> Dict[str, Any]:
    """``{"world_size": W, "ranks": [rank 0's mine, ..., rank W-1's]}``, tensors on the CPU; a collective."""
    world_size, _ = world_size_and_rank(group)
    mine = _to_cpu(mine)
    if world_size == 1:
        return {"world_size": 1, "ranks": [mine]}
    everyone = [None] * world_size
    dist.all_gather_object(everyone, mine, group=group)
    return {"world_size": world_size, "ranks": everyone}


def own_entry(saved: Dict[str, Any], group=None) -> Any:
    """This rank's entry of what :func:`gather_every_rank` returned, refusing another world size."""
    if not isinstance(saved, dict) or set(saved) != {"world_size", "ranks"}:
        raise ValueError("the state must come from EveryRankState.state_dict(): a dict of 'world_size' and "
                         f"'ranks', got {type(saved).__name__}"
                         + (f" with keys {sorted(saved)}" if isinstance(saved, dict) else ""))
    world_size, rank = world_size_and_rank(group)
    if saved["world_size"] != world_size:
        raise ValueError(f"the states were saved by {saved['world_size']} ranks but {world_size} load them: "
                         "each rank resumes its own state, so resume at the world size that saved them")
    return saved["ranks"][rank]


def _to_cpu(value):
    """``value`` with every tensor moved to the CPU (nested dicts, lists and tuples)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


def ddp_inside(model: Any) -> Any:
    """The ``DistributedDataParallel`` model under a ``torch.compile`` wrapper (what Accelerate's
    ``dynamo_backend`` and the Trainer's ``torch_compile`` give), else ``model`` itself."""
    return getattr(model, "_orig_mod", model) if isinstance(model, torch.nn.Module) else model


def not_ddp_message(model: Any, processes: int, how_to_launch: str) -> str:
    """Why ``model`` cannot take a comm hook, and what to do."""
    if processes <= 1:
        return (f"the model is a {type(model).__name__}, not a DistributedDataParallel model: with one process "
                f"({processes}) nothing is wrapped in DDP and there is no communication to hook; launch with "
                f"several processes ({how_to_launch})")
    return (f"the model is a {type(model).__name__}, not a DistributedDataParallel model, with {processes} processes: "
            "comm hooks are a DDP feature (FSDP and DeepSpeed do their own communication); train with DDP to use "
            "them")


def check_hook(hook: Any) -> Any:
    """``hook`` if it can be a comm hook (a callable ``hook(state, bucket)``), else ``TypeError``."""
    if not callable(hook):
        raise TypeError(f"`hook` must be a comm hook function hook(state, bucket), got {type(hook).__name__}")
    return hook

"""Hugging Face Accelerate: :func:`register_comm_hook`, one call after ``prepare``.

Accelerate's ``DistributedDataParallelKwargs(comm_hook=...)`` takes only its
own list of PyTorch's hooks, and ``save_state`` saves no hook state. After
``accelerator.prepare``::

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    register_comm_hook(accelerator, model, SparsifyState(method="random_block", density=0.01), sparsify_hook)

registers the hook on the prepared DDP model and registers every rank's hook
state for checkpointing (:class:`~.every_rank.EveryRankState`), so that
``accelerator.save_state(folder)`` saves it and ``accelerator.load_state(folder)``
gives each rank its own back. Needs ``pip install "ddp-hooks[accelerate]"``.

Example (one process: Accelerate wraps nothing in DDP, so there is nothing to hook)::

    >>> import torch
    >>> from accelerate import Accelerator
    >>> from ddp_hooks import SparsifyState, sparsify_hook
    >>> from ddp_hooks.integrations.accelerate import register_comm_hook
    >>> accelerator = Accelerator(cpu=True)
    >>> model = accelerator.prepare(torch.nn.Linear(2, 2))
    >>> register_comm_hook(accelerator, model, SparsifyState(), sparsify_hook)
    Traceback (most recent call last):
    ...
    ValueError: `model`: the model is a Linear, not a DistributedDataParallel model: with one process (1) nothing is wrapped in DDP and there is no communication to hook; launch with several processes (accelerate launch --num_processes N, or torchrun)
"""

from __future__ import annotations

from typing import Any, Callable, Union

from accelerate import Accelerator
from torch.nn.parallel import DistributedDataParallel

from .every_rank import EveryRankState, check_hook, ddp_inside, not_ddp_message
from .rank_files import RankFiles

__all__ = ["register_comm_hook"]


def register_comm_hook(accelerator: Accelerator, model: Any, state: Any, hook: Callable,
                       per_rank_files: bool = False) -> Union[EveryRankState, RankFiles]:
    """Register ``hook`` with ``state`` on ``model`` (as ``accelerator.prepare`` returned it) and checkpoint its state.

    Returns the :class:`~.every_rank.EveryRankState` registered with
    ``accelerator.register_for_checkpointing``. Call it on every process,
    once, before the first backward pass and before ``load_state``. A model
    compiled by Accelerate (``dynamo_backend``) is hooked through its DDP
    model. ``save_state`` then gathers every rank's hook state, a
    collective: call it on every process (as Accelerate's own docs say),
    never under ``if accelerator.is_main_process``, or it waits forever.

    With ``per_rank_files=True`` (large models, many ranks) each rank
    instead writes its own file into ``save_state``'s folder and
    ``load_state`` reads it back (:class:`~.rank_files.RankFiles`, returned):
    no process holds more than its own state.
    """
    if not isinstance(accelerator, Accelerator):
        raise TypeError(f"`accelerator` must be an accelerate.Accelerator, got {type(accelerator).__name__}")
    check_hook(hook)
    ddp_model = ddp_inside(model)
    if not isinstance(ddp_model, DistributedDataParallel):
        raise ValueError("`model`: " + not_ddp_message(ddp_model, accelerator.num_processes,
                                                       "accelerate launch --num_processes N, or torchrun"))
    saver = RankFiles(state) if per_rank_files else EveryRankState(state)
    ddp_model.register_comm_hook(state, hook)
    if per_rank_files:  # Accelerate calls these on every process, with the checkpoint's folder
        accelerator.register_save_state_pre_hook(lambda models, weights, folder: saver.save(folder))
        accelerator.register_load_state_pre_hook(lambda models, folder: saver.load(folder))
    else:
        accelerator.register_for_checkpointing(saver)
    return saver

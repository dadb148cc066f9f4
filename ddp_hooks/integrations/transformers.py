"""The Hugging Face Trainer: :func:`register_comm_hook`, one call that adds a hook to a ``Trainer``.

The Trainer wraps the model in DDP itself, inside ``trainer.train()``, and
its checkpoints save the model, optimizer, scheduler and RNG states but no
hook state. After building the Trainer::

    trainer = Trainer(model=model, args=TrainingArguments(...), train_dataset=data)
    register_comm_hook(trainer, SparsifyState(method="random_block", density=0.01), sparsify_hook)
    trainer.train()                                  # or trainer.train(resume_from_checkpoint=True)

adds a :class:`CommHookCallback` that registers the hook on the DDP model
when training begins (before the first backward pass), writes every rank's
hook state into each checkpoint folder the Trainer saves
(``<output_dir>/checkpoint-<step>/comm_hook_state.pt``, one file from the
saving process: :class:`~.every_rank.EveryRankState`), and on a resume gives
each rank its own state back from the checkpoint folder of the step the
Trainer resumed at. Needs ``pip install "ddp-hooks[transformers]"``.

Example (the callback alone; a complete run is in the README)::

    >>> from ddp_hooks import SparsifyState, sparsify_hook
    >>> from ddp_hooks.integrations.transformers import CommHookCallback
    >>> callback = CommHookCallback(lambda: None, SparsifyState(), sparsify_hook)
    >>> callback.file_name
    'comm_hook_state.pt'
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch
from torch.nn.parallel import DistributedDataParallel
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .every_rank import EveryRankState

__all__ = ["CommHookCallback", "register_comm_hook"]


def register_comm_hook(trainer: Trainer, state: Any, hook: Callable) -> "CommHookCallback":
    """Add ``hook`` with ``state`` to ``trainer``: registered when training begins, saved with its checkpoints.

    Call it once, on every process, before ``trainer.train()``; returns the
    :class:`CommHookCallback` it added.
    """
    if not isinstance(trainer, Trainer):
        raise TypeError(f"`trainer` must be a transformers.Trainer, got {type(trainer).__name__}")
    callback = CommHookCallback(lambda: trainer.model_wrapped, state, hook)
    trainer.add_callback(callback)
    return callback


class CommHookCallback(TrainerCallback):
    """A Trainer callback: registers ``hook`` on the DDP model and keeps every rank's ``state`` in checkpoints.

    Args:
        wrapped_model: a function returning the Trainer's outermost model
            (``trainer.model_wrapped``), the DDP model once training has begun.
        state: the hook's state (:class:`~ddp_hooks.SparsifyState`, or any
            with ``state_dict`` / ``load_state_dict``).
        hook: the comm hook, ``hook(state, bucket) -> Future``.
    """

    file_name = "comm_hook_state.pt"

    def __init__(self, wrapped_model: Callable[[], Any], state: Any, hook: Callable):
        if not callable(hook):
            raise TypeError(f"`hook` must be a comm hook function hook(state, bucket), got {type(hook).__name__}")
        self.wrapped_model, self.state, self.hook = wrapped_model, state, hook
        self.every_rank = EveryRankState(state)  # checks that the state can be saved
        self.registered_on = None

    def on_train_begin(self, args, state, control, **kwargs):
        model = self.wrapped_model()
        if not isinstance(model, DistributedDataParallel):
            raise ValueError(
                f"the Trainer trains a {type(model).__name__}, not a DistributedDataParallel model: launch with "
                "several processes (torchrun --nproc_per_node N, or accelerate launch) so that it wraps the model "
                "in DDP, or there is no communication to hook")
        if self.registered_on is not model:
            model.register_comm_hook(self.state, self.hook)
            self.registered_on = model
        if state.global_step > 0:  # the Trainer restored its state from a checkpoint: a resume
            path = os.path.join(self._checkpoint_folder(args, state), self.file_name)
            if not os.path.isfile(path):
                raise FileNotFoundError(
                    f"the Trainer resumed at step {state.global_step} but {path} does not exist: the hook's "
                    "residuals would restart at zero. Resume from a checkpoint saved with register_comm_hook, "
                    "in the Trainer's output_dir")
            self.every_rank.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))

    def on_save(self, args, state, control, **kwargs):
        everyone = self.every_rank.state_dict()  # a collective: the Trainer calls on_save on every process
        if args.should_save:
            torch.save(everyone, os.path.join(self._checkpoint_folder(args, state), self.file_name))

    @staticmethod
    def _checkpoint_folder(args, state) -> str:
        return os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")

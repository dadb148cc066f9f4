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
saving process: :class:`~.every_rank.EveryRankState`, with a checksum of
the weights), and on a resume gives each rank its own state back from the
checkpoint folder of the step the Trainer resumed at, in ``output_dir``
(a file whose checksum is not that of the resumed weights is refused).
Where the Trainer scales its losses (``fp16`` on a GPU: its Accelerator's
GradScaler), the callback hands that scaler to a state that takes one
(:class:`~ddp_hooks.SparsifyState`'s ``grad_scaler``), so that the hook's
residuals stay in unscaled units and skipped steps leave them alone.
Needs ``pip install "ddp-hooks[transformers]"``.

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

from .every_rank import EveryRankState, check_hook, ddp_inside, not_ddp_message
from .rank_files import RankFiles

__all__ = ["CommHookCallback", "register_comm_hook"]


def register_comm_hook(trainer: Trainer, state: Any, hook: Callable,
                       per_rank_files: bool = False) -> "CommHookCallback":
    """Add ``hook`` with ``state`` to ``trainer``: registered when training begins, saved with its checkpoints.

    Call it once, on every process, before ``trainer.train()``; returns the
    :class:`CommHookCallback` it added. ``per_rank_files``: each rank writes
    its own file into the checkpoint folder (:class:`~.rank_files.RankFiles`)
    instead of one process writing every rank's.
    """
    if not isinstance(trainer, Trainer):
        raise TypeError(f"`trainer` must be a transformers.Trainer, got {type(trainer).__name__}")
    callback = CommHookCallback(lambda: trainer.model_wrapped, state, hook,
                                grad_scaler=lambda: getattr(trainer.accelerator, "scaler", None),
                                per_rank_files=per_rank_files)
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
        grad_scaler: a function returning the Trainer's GradScaler or None
            (``trainer.accelerator.scaler``); read when training begins and
            given to a ``state`` that has a ``grad_scaler`` of None.
        per_rank_files (bool): each rank writes and reads its own file in
            the checkpoint folder (``comm_hook_state-rank<r>-of-<W>.pt``).
    """

    file_name = "comm_hook_state.pt"

    def __init__(self, wrapped_model: Callable[[], Any], state: Any, hook: Callable,
                 grad_scaler: Callable[[], Any] = lambda: None, per_rank_files: bool = False):
        check_hook(hook)
        self.wrapped_model, self.state, self.hook, self.grad_scaler = wrapped_model, state, hook, grad_scaler
        self.handed_scaler = None  # the scaler this callback gave the state (a new Trainer may bring another)
        self.every_rank = EveryRankState(state)  # checks that the state can be saved
        self.rank_files = RankFiles(state) if per_rank_files else None
        self.registered_on = None

    def on_train_begin(self, args, state, control, **kwargs):
        model = ddp_inside(self.wrapped_model())
        if not isinstance(model, DistributedDataParallel):
            raise ValueError("the Trainer's model: " + not_ddp_message(model, args.world_size,
                                                                      "torchrun --nproc_per_node N"))
        self.hand_over_scaler()
        if self.registered_on is not model:
            model.register_comm_hook(self.state, self.hook)
            self.registered_on = model
        if state.global_step > 0 and self.rank_files is not None:  # a resume from this rank's own file
            saved = self.rank_files.read(self._checkpoint_folder(args, state))
            self._check_checksum(saved, model, self.rank_files.path(self._checkpoint_folder(args, state)), state)
            self.state.load_state_dict(saved["state"])
        elif state.global_step > 0:  # the Trainer restored its state from a checkpoint: a resume
            path = os.path.join(self._checkpoint_folder(args, state), self.file_name)
            if not os.path.isfile(path):
                raise FileNotFoundError(
                    f"the Trainer resumed at step {state.global_step} but {path} does not exist: the hook's "
                    "residuals would restart at zero. Resume from a checkpoint saved with register_comm_hook, "
                    "in the Trainer's output_dir")
            saved = torch.load(path, map_location="cpu", weights_only=True)
            self._check_checksum(saved, model, path, state)
            self.every_rank.load_state_dict(saved["hook_states"])

    @staticmethod
    def _check_checksum(saved, model, path, state) -> None:
        if saved["weights_checksum"] != _checksum(model):
            raise ValueError(
                f"{path} was saved beside other weights than those the Trainer resumed from (step "
                f"{saved['global_step']}): it belongs to another run's checkpoint-{state.global_step}. Resume "
                "from a checkpoint inside the Trainer's output_dir, where this callback finds its own file")

    def hand_over_scaler(self) -> None:
        """Give the Trainer's GradScaler to a hook state that takes one (replacing one this callback gave it
        before); refuse a state holding a scaler of the user's that is not the Trainer's."""
        scaler = self.grad_scaler()
        if scaler is None or not hasattr(self.state, "grad_scaler"):
            return
        if self.state.grad_scaler is None or self.state.grad_scaler is self.handed_scaler:
            self.state.grad_scaler = self.handed_scaler = scaler
        elif self.state.grad_scaler is not scaler:
            raise ValueError(
                "the hook state's grad_scaler is not the Trainer's: the Trainer scales the losses with its own "
                f"GradScaler ({type(scaler).__name__}), so the hook would divide by another scale; build the state "
                "with grad_scaler=None and the callback hands it the Trainer's")

    def on_save(self, args, state, control, **kwargs):
        if self.rank_files is not None:  # every process writes its own file
            self.rank_files.save(self._checkpoint_folder(args, state), global_step=state.global_step,
                                 weights_checksum=_checksum(self.registered_on))
            return
        everyone = self.every_rank.state_dict()  # a collective: the Trainer calls on_save on every process
        if args.should_save:
            saved = {"global_step": state.global_step, "weights_checksum": _checksum(self.registered_on),
                     "hook_states": everyone}
            torch.save(saved, os.path.join(self._checkpoint_folder(args, state), self.file_name))

    @staticmethod
    def _checkpoint_folder(args, state) -> str:
        return os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")


def _checksum(model) -> float:
    """The sum of every weight, in float64: ties the hook's file to the weights saved beside it (which every
    rank shares under a sparsifying hook, and which the Trainer restores before training begins)."""
    with torch.no_grad():
        return float(sum(p.detach().double().sum() for p in model.parameters()))

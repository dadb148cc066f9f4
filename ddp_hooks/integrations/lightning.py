"""PyTorch Lightning: :class:`CommHook`, a callback that registers a comm hook and checkpoints every rank's state.

Lightning's ``DDPStrategy(ddp_comm_hook=...)`` registers a hook only on CUDA
devices, and its checkpoints hold no hook state, so a resumed run would
restart every residual at zero. Add the callback instead::

    trainer = Trainer(strategy="ddp", devices=2,
                      callbacks=[CommHook(SparsifyState(method="random_block", density=0.01), sparsify_hook)])

It registers the hook on the ``DistributedDataParallel`` model Lightning
builds, when fitting starts, whatever the device (CPU with gloo, CUDA with
NCCL), and stores every rank's hook state in Lightning's checkpoints (built
on every rank, written by rank 0: :class:`~.every_rank.EveryRankState`);
``trainer.fit(..., ckpt_path=...)`` gives each rank its own back. With
``CommHook(..., per_rank_dir=folder)`` each rank writes its own file into
``folder/step-<global step>`` instead and the checkpoint holds where
(:class:`~.rank_files.RankFiles`): no process holds another's state. Needs
``pip install "ddp-hooks[lightning]"``.

Local AdaAlter (and any local SGD) leaves the ranks' weights and optimizer
states different between averagings, and Lightning checkpoints rank 0's.
Build it in ``configure_optimizers`` on the DDP model Lightning made (it
registers its own hook), and add :class:`EveryRankCheckpoint`::

    def configure_optimizers(self):
        hook_state, optimizer = build_local_adaalter(self.trainer.strategy.model, lr=0.1, period=8,
                                                     warmup_steps=100)
        return optimizer

    trainer = Trainer(strategy="ddp", devices=2, callbacks=[EveryRankCheckpoint()])

Example (the callback alone; a complete run is in the README)::

    >>> from ddp_hooks import SparsifyState, sparsify_hook
    >>> from ddp_hooks.integrations.lightning import CommHook
    >>> callback = CommHook(SparsifyState(method="random_block", density=0.01), sparsify_hook)
    >>> callback.state_key
    'CommHook'
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, Optional

from lightning.pytorch.callbacks import Callback
from torch.nn.parallel import DistributedDataParallel

from .every_rank import EveryRankState, check_hook, gather_every_rank, own_entry
from .rank_files import RankFiles

__all__ = ["CommHook", "EveryRankCheckpoint"]


class CommHook(Callback):
    """Registers ``hook`` with ``state`` on Lightning's DDP model, on every device type; checkpoints every rank's state.

    Args:
        state: the hook's state (:class:`~ddp_hooks.SparsifyState`, or any
            with ``state_dict`` / ``load_state_dict``).
        hook: the comm hook, ``hook(state, bucket) -> Future``
            (:func:`~ddp_hooks.sparsify_hook`).
        per_rank_dir (str): a folder every rank can write to: each rank saves
            its own file there at each checkpoint, and the checkpoint holds
            only where; None (default): every rank's state in the checkpoint.
    """

    def __init__(self, state: Any, hook: Callable, per_rank_dir: Optional[str] = None):
        check_hook(hook)
        self.state, self.hook = state, hook
        self.every_rank = EveryRankState(state)  # checks that the state can be saved
        self.rank_files = None if per_rank_dir is None else RankFiles(state)
        self.per_rank_dir = per_rank_dir
        self.registered_on = None  # the DDP model the hook is registered on
        self.trainer = None

    @property
    def state_key(self) -> str:
        return "CommHook"

    def on_fit_start(self, trainer, pl_module) -> None:
        self.trainer = trainer
        model = trainer.strategy.model
        if not isinstance(model, DistributedDataParallel):
            raise ValueError(
                f"CommHook needs Lightning to train a DistributedDataParallel model (Trainer(strategy='ddp') or "
                f"DDPStrategy(...)), but trainer.strategy is {type(trainer.strategy).__name__} and its model a "
                f"{type(model).__name__}: there is no DDP communication to hook")
        if self.registered_on is model:  # a second fit on the same model: already registered
            return
        try:
            model.register_comm_hook(self.state, self.hook)
        except RuntimeError as error:
            raise RuntimeError(f"CommHook could not register its hook: {error}. Pass the hook to CommHook only, "
                               "not also to DDPStrategy(ddp_comm_hook=...)") from error
        self.registered_on = model

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: Dict[str, Any]) -> None:
        if self.state_key not in checkpoint.get("callbacks", {}):
            raise ValueError(f"the checkpoint holds no {self.state_key} state (saved without this callback, or "
                             "with weights_only=True): the hook's residuals would restart at zero. Resume from a "
                             "checkpoint saved with CommHook in the callbacks")

    def state_dict(self) -> Dict[str, Any]:
        """Every rank's hook state (a collective: Lightning calls it on every rank when it saves); with
        ``per_rank_dir``, this rank's written to its own file, and the folder."""
        if self.rank_files is None:
            return self.every_rank.state_dict()
        folder = os.path.join(self.per_rank_dir, f"step-{self.trainer.global_step}")
        self.rank_files.save(folder)
        return {"per_rank_folder": folder}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """This rank's own hook state, from a checkpoint saved at the same world size."""
        if "per_rank_folder" in state_dict:
            RankFiles(self.state).load(state_dict["per_rank_folder"])
        else:
            self.every_rank.load_state_dict(state_dict)


class EveryRankCheckpoint(Callback):
    """Keeps every rank's weights and optimizer states in Lightning's checkpoints; restores each rank's own.

    For training whose ranks differ between synchronisations (Local
    AdaAlter, local SGD): Lightning builds its checkpoint on every rank but
    writes rank 0's, so a resume would give every rank rank 0's weights and
    local accumulators (``LocalAdaAlter`` refuses to load another rank's
    state mid-round). Saving gathers every rank's ``state_dict`` and
    ``optimizer_states`` into the checkpoint (a collective; each rank holds
    all of them on the CPU meanwhile); loading puts this rank's own in place
    of rank 0's, so that the resume is bitwise the uninterrupted run. The
    checkpoint loads at the world size that saved it.
    """

    def __init__(self):
        self.pending_weights = None  # this rank's weights, between loading a checkpoint and the DDP model's setup

    @property
    def state_key(self) -> str:
        return "EveryRankCheckpoint"

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: Dict[str, Any]) -> None:
        mine = {"state_dict": checkpoint["state_dict"], "optimizer_states": checkpoint.get("optimizer_states", [])}
        checkpoint[self.state_key] = gather_every_rank(mine)

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: Dict[str, Any]) -> None:
        if self.state_key not in checkpoint:
            raise ValueError(f"the checkpoint holds no {self.state_key} entry (saved without this callback, or with "
                             "weights_only=True): it has rank 0's weights and optimizer states only")
        own = own_entry(checkpoint[self.state_key])
        checkpoint["optimizer_states"] = own["optimizer_states"]  # Lightning restores the optimizers after this
        if trainer.strategy.restore_checkpoint_after_setup:
            pl_module.load_state_dict(own["state_dict"])
        else:  # the DDP model is not built yet, and building it broadcasts rank 0's weights: load them after
            self.pending_weights = own["state_dict"]

    def on_fit_start(self, trainer, pl_module) -> None:
        if self.pending_weights is not None:
            pl_module.load_state_dict(self.pending_weights)
            self.pending_weights = None

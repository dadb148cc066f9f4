"""Our hooks where users train without a DDP loop of their own: one module per framework.

* :mod:`.lightning`: :class:`~.lightning.CommHook`, a PyTorch Lightning
  callback that registers a hook on every device type and keeps every rank's
  hook state in Lightning's checkpoints.
* :mod:`.accelerate`: :func:`~.accelerate.register_comm_hook`, one call after
  ``accelerator.prepare`` that registers a hook and makes ``save_state`` /
  ``load_state`` carry every rank's hook state.
* :mod:`.transformers`: :func:`~.transformers.register_comm_hook`, one call
  that adds a hook to a Hugging Face ``Trainer`` and to its checkpoints.
* :mod:`.fsdp`: :class:`~.fsdp.SparseReplicas`, FSDP2's all-reduce between
  replicas (HSDP) through the sparsifying compressor, through FSDP2's
  all-reduce hook; its state saves through ``torch.distributed.checkpoint``.
* :mod:`.every_rank`: :class:`~.every_rank.EveryRankState`, what the first three
  use: a hook state whose ``state_dict`` holds every rank's, for frameworks
  that write their checkpoint from one process; :mod:`.rank_files`:
  :class:`~.rank_files.RankFiles`, each rank's state in its own file
  instead, for models whose residuals are too large to gather
  (``per_rank_files=True`` / ``per_rank_dir=...`` in the three helpers).

Each framework module imports its framework, so import it only where the
framework is installed (``pip install "ddp-hooks[lightning]"``,
``"ddp-hooks[accelerate]"`` or ``"ddp-hooks[transformers]"``); this package
itself imports none of them.
"""

from .every_rank import EveryRankState

__all__ = ["EveryRankState"]

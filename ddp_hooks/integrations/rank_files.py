"""A hook state saved as one file per rank: checkpoints whose size does not grow on any process with the world.

:class:`~.every_rank.EveryRankState` gathers every rank's hook state into
every process, so that frameworks writing their checkpoint from one process
keep them all: simple, but each process then holds ``W`` residuals, each of
the model's size. :class:`RankFiles` instead has each rank write its own
file into the checkpoint's folder, ``<name>-rank<r>-of-<W>.pt``, and read
its own back: no collective, one rank's state per process. The folder must
be one every rank can write to and read from (a shared file system, or the
same path on every node when each node resumes its own ranks).

Example (one process)::

    >>> import tempfile
    >>> from ddp_hooks import SparsifyState
    >>> folder = tempfile.mkdtemp()
    >>> RankFiles(SparsifyState(density=0.1)).save(folder).endswith("comm_hook_state-rank0-of-1.pt")
    True
    >>> RankFiles(SparsifyState(density=0.1)).load(folder)
"""

from __future__ import annotations

import glob
import os
from typing import Any

import torch

from .._internal.collectives import world_size_and_rank

__all__ = ["RankFiles"]


class RankFiles:
    """``hook_state`` saved and loaded as this rank's own file in a folder.

    Args:
        hook_state: a state with ``state_dict()`` and ``load_state_dict(state)``.
        name (str): the files' name before ``-rank<r>-of-<W>.pt``.
        group: the process group whose ranks save (default: the whole world).
    """

    def __init__(self, hook_state: Any, name: str = "comm_hook_state", group=None):
        for method in ("state_dict", "load_state_dict"):
            if not callable(getattr(hook_state, method, None)):
                raise TypeError(f"`hook_state` must have a {method}() method (a hook state such as SparsifyState), "
                                f"got {type(hook_state).__name__}")
        self.hook_state, self.name, self.group = hook_state, name, group

    def path(self, folder: str) -> str:
        """This rank's file in ``folder``."""
        world_size, rank = world_size_and_rank(self.group)
        return os.path.join(folder, f"{self.name}-rank{rank}-of-{world_size}.pt")

    def save(self, folder: str, **extra: Any) -> str:
        """Write this rank's state (and ``extra`` entries) to its file in ``folder``; returns the path."""
        os.makedirs(folder, exist_ok=True)
        path = self.path(folder)
        torch.save({"state": self.hook_state.state_dict(), **extra}, path + ".tmp")
        os.replace(path + ".tmp", path)  # a crash mid-write leaves the previous file whole
        return path

    def read(self, folder: str) -> dict:
        """This rank's saved entry (``state`` and the ``extra`` entries), refusing another world size."""
        path = self.path(folder)
        if not os.path.isfile(path):
            world_size, _ = world_size_and_rank(self.group)
            others = sorted(os.path.basename(p) for p in glob.glob(os.path.join(folder, f"{self.name}-rank*.pt")))
            listed = f"; the folder holds {others[:3]}{' ...' if len(others) > 3 else ''}"
            if not others:
                why = (": the hook's residuals would restart at zero; resume from a checkpoint saved with "
                       "per-rank files")
            elif not any(name.endswith(f"-of-{world_size}.pt") for name in others):
                why = (listed + ": the states were saved at another world size, and each rank resumes its own, "
                       "so resume at the world size that saved them")
            else:
                why = (listed + ", but not this rank's: every rank must reach the folder it saved to (a shared "
                       "file system), and each must have saved")
            raise FileNotFoundError(f"{path} does not exist{why}")
        return torch.load(path, map_location="cpu", weights_only=True)

    def load(self, folder: str) -> None:
        """Load this rank's own state from ``folder``."""
        self.hook_state.load_state_dict(self.read(folder)["state"])

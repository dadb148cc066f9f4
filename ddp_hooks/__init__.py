"""PyTorch DDP communication hooks that make data-parallel training cheaper to communicate.

Sparsification with error feedback (Eghlidi & Jaggi, 2020)::

    from ddp_hooks import SparsifyState, sparsify_hook
    ddp_model.register_comm_hook(SparsifyState(method="random_block", density=0.01), sparsify_hook)

Test helpers live in :mod:`ddp_hooks.testing`.
"""

from .sparsify import sparsify_hook
from .sparsify_state import SparsifyState

__version__ = "0.1.0"

__all__ = ["SparsifyState", "sparsify_hook", "__version__"]

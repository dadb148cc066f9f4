"""PyTorch DDP communication hooks that make data-parallel training cheaper to communicate.

Sparsification with error feedback (Eghlidi & Jaggi, 2020)::

    from ddp_hooks import SparsifyState, sparsify_hook
    ddp_model.register_comm_hook(SparsifyState(method="random_block", density=0.01), sparsify_hook)
    # the optimizer stays as it is, momentum SGD included: the hook counts its momentum in sends

Local AdaAlter (Xie, Koyejo, Gupta, Lin, 2019)::

    from ddp_hooks import build_local_adaalter
    hook_state, opt = build_local_adaalter(ddp_model, lr=0.5, eps=1.0, period=4, warmup_steps=600)

Test helpers live in :mod:`ddp_hooks.testing`.
"""

from .adaalter import (AdaAlterAverager, LocalAdaAlter, LocalAdaAlterSchedule, LocalSGDState, OuterOptimizer, OuterSGD,
                       SparseAverage, build_local_adaalter, local_sgd_hook)
from .baselines import build_local_sgd, build_sync_adagrad
from .sparsify import SparsifyState, build_sparsify_sgd, check_optimizer, sparsify_hook

__version__ = "0.1.0"

__all__ = [
    "SparsifyState",
    "sparsify_hook",
    "build_sparsify_sgd",
    "check_optimizer",
    "LocalAdaAlter",
    "build_local_adaalter",
    "AdaAlterAverager",
    "OuterSGD",
    "OuterOptimizer",
    "SparseAverage",
    "LocalSGDState",
    "local_sgd_hook",
    "LocalAdaAlterSchedule",
    "build_sync_adagrad",
    "build_local_sgd",
    "__version__",
]

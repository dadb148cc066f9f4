"""Sparsification with error feedback (Eghlidi & Jaggi, 2020): the DDP comm hook and its parts.

Users need :class:`SparsifyState`, :func:`sparsify_hook` and, to build the
optimizer with it, :func:`build_sparsify_sgd` (all re-exported by
:mod:`ddp_hooks`). The parts, one idea per module:

* :mod:`.options`: the options, checked and frozen, with their checkpoint codes;
* :mod:`.state`: the per-rank state; :mod:`.checkpoint`: saving and loading it;
* :mod:`.hook`: the hook's control flow; :mod:`.step_run`: one backward pass;
* :mod:`.exchange`: one exchange (select, pack, collective); :mod:`.commit`: the end of a step;
* :mod:`.error_feedback`: the residual and velocity recursions; :mod:`.nonfinite`: inf/NaN and idle parameters;
* :mod:`.layout`, :mod:`.residuals`, :mod:`.last_update`, :mod:`.sparse_output`, :mod:`.scratch`: storage;
* :mod:`.momenta`, :mod:`.optimizer_check`, :mod:`.optimizer`: the optimizer's momentum and its pairing;
* :mod:`.selectors`: the coordinate selectors, one file each, behind one seam.
"""

from .hook import sparsify_hook
from .optimizer import build_sparsify_sgd, check_optimizer
from .options import SparsifyOptions
from .selectors import Selector, register_selector
from .state import SparsifyState

__all__ = ["SparsifyState", "SparsifyOptions", "sparsify_hook", "build_sparsify_sgd", "check_optimizer",
           "Selector", "register_selector"]

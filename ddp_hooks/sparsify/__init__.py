"""Sparsification with error feedback (Eghlidi & Jaggi, 2020): the DDP comm hook and its parts.

Users need :class:`SparsifyState`, :func:`sparsify_hook` and, to build the
optimizer with it, :func:`build_sparsify_sgd` (all re-exported by
:mod:`ddp_hooks`). The parts, one idea per module:

* :mod:`.compressor`: one flat gradient's exchange, stage by stage (compensate, select, pack,
  communicate, unpack, fold), for any carrier;
* :mod:`.hook`: the DDP carrier: buckets and parameter keys, one verdict per step, the loss scale,
  the optimizer's momentum counted in sends;
* :mod:`.memory`: what is kept per parameter from step to step (residuals, last updates, layouts);
* :mod:`.options`: the options, checked and frozen, with their checkpoint codes;
* :mod:`.state`: the per-rank state; :mod:`.checkpoint`: saving and loading it;
* :mod:`.momenta`, :mod:`.optimizer_check`, :mod:`.optimizer`: the optimizer's momentum and its pairing;
* :mod:`.selectors`: the coordinate selectors, one file each, behind one seam.
"""

from .compressor import SparseCompressor
from .hook import sparsify_hook
from .optimizer import build_sparsify_sgd, check_optimizer
from .options import SparsifyOptions
from .selectors import Selector, register_selector
from .state import SparsifyState

__all__ = ["SparsifyState", "SparsifyOptions", "SparseCompressor", "sparsify_hook", "build_sparsify_sgd", "check_optimizer",
           "Selector", "register_selector"]

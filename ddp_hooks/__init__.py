"""PyTorch DDP communication hooks that make data-parallel training cheaper to communicate.

Public API: see README.md. Test helpers live in :mod:`ddp_hooks.testing`.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]

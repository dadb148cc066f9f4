"""Shared fixtures; puts this folder on ``sys.path`` so that tests in its subfolders import its helpers
(``small_mlp``) by module name."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _restore_torch_globals():
    """Tests may change the default dtype or the global RNG; put them back."""
    dtype = torch.get_default_dtype()
    rng = torch.random.get_rng_state()
    yield
    torch.set_default_dtype(dtype)
    torch.random.set_rng_state(rng)

"""The Accelerate helper: one call after ``prepare`` runs the hook as plain DDP does, and ``save_state`` /
``load_state`` resume bit for bit."""

import os

import pytest
import torch

pytest.importorskip("accelerate", reason="Accelerate is not installed: pip install -e '.[accelerate]'")

from ddp_hooks.testing import run_distributed  # noqa: E402
from framework_jobs import STEPS_PER_EPOCH, as_launched_process, check_against_plain, plain_ddp  # noqa: E402

STEPS = 2 * STEPS_PER_EPOCH


def _train(rank, world, steps, save_to=None, resume_from=None):
    """The user's loop under Accelerate: ``prepare``, the one added call, ``backward`` through the accelerator."""
    from accelerate import Accelerator

    from ddp_hooks import sparsify_hook
    from ddp_hooks.integrations.accelerate import register_comm_hook
    from framework_jobs import LR, loss_at, new_state
    from small_mlp import flat, small_mlp

    as_launched_process(rank, world)
    accelerator = Accelerator(cpu=True)
    net = small_mlp()
    model, optimizer = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=LR))
    state = new_state()
    register_comm_hook(accelerator, model, state, sparsify_hook)
    first = 0
    if resume_from is not None:
        accelerator.load_state(resume_from)
        first = STEPS_PER_EPOCH
    for step in range(first, steps):
        optimizer.zero_grad()
        accelerator.backward(loss_at(model, rank, step))
        optimizer.step()
    if save_to is not None:
        accelerator.save_state(save_to)
    return flat(accelerator.unwrap_model(model).parameters()), state.stats()


def _accelerate_against_plain(rank, world, folder):
    plain = plain_ddp(rank, world, STEPS)
    whole = _train(rank, world, STEPS)
    path = os.path.join(folder, "half")
    _train(rank, world, STEPS_PER_EPOCH, save_to=path)
    resumed = _train(rank, world, STEPS, resume_from=path)
    return plain, whole, resumed


def test_the_hook_runs_trains_as_plain_ddp_and_resumes_bitwise(tmp_path):
    results = run_distributed(_accelerate_against_plain, 2, str(tmp_path), timeout=300)
    check_against_plain(results, STEPS)

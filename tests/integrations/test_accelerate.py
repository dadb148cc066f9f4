"""The Accelerate helper: one call after ``prepare`` runs the hook as plain DDP does, and ``save_state`` /
``load_state`` resume bit for bit."""

import os

import pytest
import torch

pytest.importorskip("accelerate", reason="Accelerate is not installed: pip install -e '.[accelerate]'")

from ddp_hooks.testing import run_distributed  # noqa: E402
from framework_jobs import STEPS_PER_EPOCH, as_launched_process, check_against_plain, plain_ddp  # noqa: E402

STEPS = 2 * STEPS_PER_EPOCH


def _train(rank, world, steps, save_to=None, resume_from=None, per_rank=False):
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
    register_comm_hook(accelerator, model, state, sparsify_hook, per_rank_files=per_rank)
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


def _accelerate_against_plain(rank, world, folder, per_rank):
    plain = plain_ddp(rank, world, STEPS)
    whole = _train(rank, world, STEPS)
    path = os.path.join(folder, "half")
    _train(rank, world, STEPS_PER_EPOCH, save_to=path, per_rank=per_rank)
    resumed = _train(rank, world, STEPS, resume_from=path, per_rank=per_rank)
    return plain, whole, resumed


@pytest.mark.parametrize("per_rank", [False, True], ids=["every rank in one file", "a file per rank"])
def test_the_hook_runs_trains_as_plain_ddp_and_resumes_bitwise(tmp_path, per_rank):
    results = run_distributed(_accelerate_against_plain, 2, str(tmp_path), per_rank, timeout=300)
    check_against_plain(results, STEPS)
    saved = sorted(os.listdir(tmp_path / "half"))
    per_rank_files = ["comm_hook_state-rank0-of-2.pt", "comm_hook_state-rank1-of-2.pt"]
    assert all(name in saved for name in per_rank_files) == per_rank
    assert ("custom_checkpoint_0.pkl" in saved) != per_rank

"""The Lightning callback: the hook runs on CPU, trains as plain DDP does, and a checkpoint resumes bit for bit."""

import os

import pytest
import torch

pytest.importorskip("lightning", reason="Lightning is not installed: pip install -e '.[lightning]'")

from ddp_hooks.testing import run_distributed  # noqa: E402
from framework_jobs import STEPS_PER_EPOCH, as_launched_process, check_against_plain, plain_ddp  # noqa: E402

EPOCHS = 2


def _fit(rank, world, epochs, save_to=None, resume_from=None):
    import lightning.pytorch as L
    from lightning.pytorch.strategies import DDPStrategy

    from ddp_hooks import sparsify_hook
    from ddp_hooks.integrations.lightning import CommHook
    from framework_jobs import LR, loss_at, new_state
    from small_mlp import flat, small_mlp

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = small_mlp()

        def forward(self, x):
            return self.net(x)

        def training_step(self, index, _):
            return loss_at(self, self.trainer.global_rank, int(self.global_step))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR)

        def train_dataloader(self):  # one dummy item per step; the batch comes from (rank, step)
            return torch.utils.data.DataLoader(torch.arange(STEPS_PER_EPOCH * world), batch_size=1)

    as_launched_process(rank, world)
    state = new_state()
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=DDPStrategy(process_group_backend="gloo"),
                        max_epochs=epochs, callbacks=[CommHook(state, sparsify_hook)], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    module = Module()
    trainer.fit(module, ckpt_path=resume_from)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    return flat(module.net.parameters()), state.stats()


def _lightning_against_plain(rank, world, folder):
    plain = plain_ddp(rank, world, EPOCHS * STEPS_PER_EPOCH)
    whole = _fit(rank, world, EPOCHS)
    path = os.path.join(folder, "half.ckpt")
    _fit(rank, world, 1, save_to=path)
    resumed = _fit(rank, world, EPOCHS, resume_from=path)
    return plain, whole, resumed


def test_the_hook_runs_trains_as_plain_ddp_and_resumes_bitwise(tmp_path):
    results = run_distributed(_lightning_against_plain, 2, str(tmp_path), timeout=300)
    check_against_plain(results, EPOCHS * STEPS_PER_EPOCH)

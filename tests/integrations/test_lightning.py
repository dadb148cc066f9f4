"""The Lightning callbacks: a hook runs on CPU and trains as plain DDP does, Local AdaAlter too, and a
checkpoint resumes bit for bit (mid-round for Local AdaAlter, where the ranks differ)."""

import os

import pytest
import torch

pytest.importorskip("lightning", reason="Lightning is not installed: pip install -e '.[lightning]'")

from ddp_hooks.testing import run_distributed  # noqa: E402
from framework_jobs import STEPS_PER_EPOCH, as_launched_process, check_against_plain, plain_ddp  # noqa: E402

EPOCHS = 2


def _fit(rank, world, epochs, callback, make_optimizer, save_to=None, resume_from=None):
    """Lightning's own loop over ``epochs`` of ``STEPS_PER_EPOCH`` steps; the loss at each step is plain DDP's;
    ``make_optimizer(module)`` is what ``configure_optimizers`` returns. Returns the final weights, flat."""
    import lightning.pytorch as L
    from lightning.pytorch.strategies import DDPStrategy

    from framework_jobs import loss_at
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
            return make_optimizer(self)

        def train_dataloader(self):  # one dummy item per step; the batch comes from (rank, step)
            return torch.utils.data.DataLoader(torch.arange(STEPS_PER_EPOCH * world), batch_size=1)

    as_launched_process(rank, world)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=DDPStrategy(process_group_backend="gloo"),
                        max_epochs=epochs, callbacks=[callback], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    module = Module()
    trainer.fit(module, ckpt_path=resume_from)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    return flat(module.net.parameters())


def _sgd(module):
    from framework_jobs import LR

    return torch.optim.SGD(module.parameters(), lr=LR)


def _fit_with_hook(rank, world, epochs, per_rank_dir=None, **checkpointing):
    from ddp_hooks import sparsify_hook
    from ddp_hooks.integrations.lightning import CommHook
    from framework_jobs import new_state

    state = new_state()
    callback = CommHook(state, sparsify_hook, per_rank_dir=per_rank_dir)
    return _fit(rank, world, epochs, callback, _sgd, **checkpointing), state.stats()


def _lightning_against_plain(rank, world, folder, per_rank):
    per_rank_dir = os.path.join(folder, "hook-states") if per_rank else None
    plain = plain_ddp(rank, world, EPOCHS * STEPS_PER_EPOCH)
    whole = _fit_with_hook(rank, world, EPOCHS)
    path = os.path.join(folder, "half.ckpt")
    _fit_with_hook(rank, world, 1, per_rank_dir, save_to=path)
    resumed = _fit_with_hook(rank, world, EPOCHS, per_rank_dir, resume_from=path)
    return plain, whole, resumed


@pytest.mark.parametrize("per_rank", [False, True], ids=["every rank in the checkpoint", "a file per rank"])
def test_the_hook_runs_trains_as_plain_ddp_and_resumes_bitwise(tmp_path, per_rank):
    results = run_distributed(_lightning_against_plain, 2, str(tmp_path), per_rank, timeout=300)
    check_against_plain(results, EPOCHS * STEPS_PER_EPOCH)
    saved = torch.load(tmp_path / "half.ckpt", weights_only=False)["callbacks"]["CommHook"]
    if per_rank:  # the checkpoint holds where; each rank's file holds its own state
        assert saved == {"per_rank_folder": os.path.join(str(tmp_path), "hook-states", f"step-{STEPS_PER_EPOCH}")}
        assert sorted(os.listdir(saved["per_rank_folder"])) == [f"comm_hook_state-rank{r}-of-2.pt" for r in (0, 1)]
    else:
        assert len(saved["ranks"]) == 2


def _fit_local_adaalter(rank, world, epochs, sparse, **checkpointing):
    from framework_jobs import local_adaalter

    from ddp_hooks.integrations.lightning import EveryRankCheckpoint

    def make_optimizer(module):
        return local_adaalter(module.trainer.strategy.model, sparse)[1]  # registers its own hook

    return _fit(rank, world, epochs, EveryRankCheckpoint(), make_optimizer, **checkpointing)


def _local_adaalter_against_plain(rank, world, folder, sparse):
    from framework_jobs import plain_ddp_local_adaalter

    plain = plain_ddp_local_adaalter(rank, world, EPOCHS * STEPS_PER_EPOCH, sparse)
    whole = _fit_local_adaalter(rank, world, EPOCHS, sparse)
    path = os.path.join(folder, "half.ckpt")
    _fit_local_adaalter(rank, world, 1, sparse, save_to=path)  # after step 4: mid-round, the ranks differ
    resumed = _fit_local_adaalter(rank, world, EPOCHS, sparse, resume_from=path)
    return plain, whole, resumed


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_local_adaalter_trains_as_plain_ddp_and_each_rank_resumes_its_own_state(tmp_path, sparse):
    (plain0, whole0, resumed0), (plain1, whole1, resumed1) = run_distributed(
        _local_adaalter_against_plain, 2, str(tmp_path), sparse, timeout=300)
    assert not torch.equal(whole0, whole1)  # the run ends mid-round (step 8): the ranks differ
    assert torch.equal(whole0, plain0) and torch.equal(whole1, plain1)
    assert torch.equal(resumed0, whole0) and torch.equal(resumed1, whole1)


def test_a_checkpoint_without_the_hooks_state_is_refused():
    from ddp_hooks import sparsify_hook
    from ddp_hooks.integrations.lightning import CommHook
    from framework_jobs import new_state

    with pytest.raises(ValueError, match=r"holds no CommHook state .* residuals would restart at zero"):
        CommHook(new_state(), sparsify_hook).on_load_checkpoint(None, None, {"callbacks": {}})

"""The Hugging Face Trainer helper: the hook runs as in plain DDP, and a Trainer checkpoint resumes bit for bit."""

import os

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed: pip install -e '.[transformers]'")

from ddp_hooks.testing import run_distributed  # noqa: E402
from framework_jobs import STEPS_PER_EPOCH, as_launched_process, check_against_plain, plain_ddp  # noqa: E402

STEPS = 2 * STEPS_PER_EPOCH


def _train(rank, world, folder, resume=False):
    """The Trainer with SGD at a constant lr, no clipping; the model's loss is plain DDP's at the same step."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from ddp_hooks import sparsify_hook
    from ddp_hooks.integrations.transformers import register_comm_hook
    from framework_jobs import LR, loss_at, new_state
    from small_mlp import flat, small_mlp

    class StepLoss(torch.nn.Module):
        """Ignores its batch: the loss at step ``self.step`` of plain DDP's loop, on this rank."""

        def __init__(self):
            super().__init__()
            self.net, self.step = small_mlp(), 0

        def forward(self, index):
            return {"loss": loss_at(self.net, rank, self.step)}

    class FollowStep(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            model.step = state.global_step

    as_launched_process(rank, world)
    model = StepLoss()
    args = TrainingArguments(
        output_dir=folder, use_cpu=True, ddp_backend="gloo", max_steps=STEPS, per_device_train_batch_size=1,
        optim="sgd", learning_rate=LR, lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0,
        save_strategy="steps", save_steps=STEPS_PER_EPOCH, logging_strategy="no", report_to="none",
        disable_tqdm=True, dataloader_num_workers=0)
    data = [{"index": i} for i in range(STEPS * world)]
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[FollowStep()])
    state = new_state()
    register_comm_hook(trainer, state, sparsify_hook)
    trainer.train(resume_from_checkpoint=os.path.join(folder, f"checkpoint-{STEPS_PER_EPOCH}") if resume else None)
    return flat(model.net.parameters()), state.stats()


def _trainer_against_plain(rank, world, folder):
    plain = plain_ddp(rank, world, STEPS)
    whole = _train(rank, world, folder)  # saves checkpoints at half and at the end
    resumed = _train(rank, world, folder, resume=True)
    return plain, whole, resumed


def test_the_hook_runs_trains_as_plain_ddp_and_resumes_bitwise(tmp_path):
    results = run_distributed(_trainer_against_plain, 2, str(tmp_path), timeout=300)
    assert os.path.isfile(tmp_path / f"checkpoint-{STEPS_PER_EPOCH}" / "comm_hook_state.pt")
    check_against_plain(results, STEPS)


def _refusals(rank, world, folder):
    from types import SimpleNamespace

    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddp_hooks import sparsify_hook
    from ddp_hooks.integrations.transformers import CommHookCallback
    from framework_jobs import new_state
    from small_mlp import small_mlp

    errors = []
    plain = small_mlp()
    try:  # one process: the Trainer did not wrap the model in DDP
        CommHookCallback(lambda: plain, new_state(), sparsify_hook).on_train_begin(SimpleNamespace(world_size=1),
                                                                                   None, None)
    except ValueError as error:
        errors.append(str(error))
    resumed_at = SimpleNamespace(global_step=4)
    try:  # a resume from a checkpoint that holds no hook state
        callback = CommHookCallback(lambda: DDP(small_mlp()), new_state(), sparsify_hook)
        callback.on_train_begin(SimpleNamespace(output_dir=folder), resumed_at, None)
    except FileNotFoundError as error:
        errors.append(str(error))
    # a checkpoint folder of the same step from another run: its file does not match the resumed weights
    other = os.path.join(folder, "checkpoint-4")
    os.makedirs(other, exist_ok=True)
    torch.save({"global_step": 4, "weights_checksum": 1.5, "hook_states": {}}, os.path.join(other, "comm_hook_state.pt"))
    try:
        callback.on_train_begin(SimpleNamespace(output_dir=folder), resumed_at, None)
    except ValueError as error:
        errors.append(str(error))
    return errors


def test_a_model_without_ddp_and_a_checkpoint_without_or_with_another_hook_state_are_refused(tmp_path):
    not_ddp, missing, other_run = run_distributed(_refusals, 1, str(tmp_path))[0]
    assert "not a DistributedDataParallel model" in not_ddp and "Sequential" in not_ddp and "torchrun" in not_ddp
    assert str(tmp_path / "checkpoint-4" / "comm_hook_state.pt") in missing and "restart at zero" in missing
    assert "saved beside other weights than those the Trainer resumed from" in other_run

"""The Hugging Face Trainer helper: the hook runs as in plain DDP, and a Trainer checkpoint resumes bit for bit."""

import os
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed: pip install -e '.[transformers]'")

from ddp_hooks.testing import run_distributed  # noqa: E402
from framework_jobs import STEPS_PER_EPOCH, as_launched_process, check_against_plain, plain_ddp  # noqa: E402

STEPS = 2 * STEPS_PER_EPOCH


def _train(rank, world, folder, resume=False, per_rank=False):
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
    register_comm_hook(trainer, state, sparsify_hook, per_rank_files=per_rank)
    trainer.train(resume_from_checkpoint=os.path.join(folder, f"checkpoint-{STEPS_PER_EPOCH}") if resume else None)
    return flat(model.net.parameters()), state.stats()


def _trainer_against_plain(rank, world, folder, per_rank):
    plain = plain_ddp(rank, world, STEPS)
    whole = _train(rank, world, folder, per_rank=per_rank)  # saves checkpoints at half and at the end
    resumed = _train(rank, world, folder, resume=True, per_rank=per_rank)
    return plain, whole, resumed


@pytest.mark.parametrize("per_rank", [False, True], ids=["every rank in one file", "a file per rank"])
def test_the_hook_runs_trains_as_plain_ddp_and_resumes_bitwise(tmp_path, per_rank):
    results = run_distributed(_trainer_against_plain, 2, str(tmp_path), per_rank, timeout=300)
    saved = sorted(os.listdir(tmp_path / f"checkpoint-{STEPS_PER_EPOCH}"))
    assert ("comm_hook_state.pt" in saved) != per_rank
    assert all(f"comm_hook_state-rank{r}-of-2.pt" in saved for r in (0, 1)) == per_rank
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


DEFAULTS_STEPS = 512
SELECTORS = {"topk": {"aggregation": "allgather"}, "random_block": {}, "randomk": {}, "shared_topk": {}}


def _defaults_trainer(rank, world, folder, method, max_steps=None, save_steps=None, resume=False):
    """The Trainer with ``TrainingArguments`` at their defaults (fused AdamW at lr 5e-5, linear decay, gradient
    clipping at 1.0, weight decay 0) and bf16 autocast, as the CPU allows, on a 4-class task; ``method`` None: PyTorch's own all-reduce (no hook).
    Returns the losses it logged (every 64 steps), its weights (flat), the hook's stats and the steps it took."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from ddp_hooks import SparsifyState, sparsify_hook
    from ddp_hooks.integrations.transformers import register_comm_hook
    from small_mlp import flat

    class CountSteps(TrainerCallback):
        taken = 0

        def on_step_end(self, args, state, control, **kwargs):
            CountSteps.taken += 1

    class Classifier(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))

        def forward(self, inputs, labels):
            logits = self.net(inputs)
            return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}

    draws = torch.Generator().manual_seed(0)
    teacher = torch.randn(16, 4, generator=draws)
    x = torch.randn(DEFAULTS_STEPS * 8 * world, 16, generator=draws)
    data = [{"inputs": row, "labels": int(label)} for row, label in zip(x, (x @ teacher).argmax(1))]
    model = Classifier()
    args = TrainingArguments(  # the defaults, but for where and how often to write, the batch size, and bf16
        output_dir=os.path.join(folder, method or "dense"), use_cpu=True, ddp_backend="gloo", bf16=True,
        per_device_train_batch_size=8, num_train_epochs=1, max_steps=max_steps or -1, logging_steps=64,
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500, report_to="none",
        disable_tqdm=True, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[CountSteps()])
    state = None
    if method is not None:
        state = SparsifyState(method=method, density=0.01, **SELECTORS[method])
        register_comm_hook(trainer, state, sparsify_hook)
    trainer.train(resume_from_checkpoint=os.path.join(args.output_dir, f"checkpoint-{save_steps}") if resume else None)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return losses, flat(model.net.parameters()), None if state is None else state.stats(), CountSteps.taken


def _defaults_every_selector(rank, world, folder):
    from framework_jobs import as_launched_process

    as_launched_process(rank, world)
    runs = {method: _defaults_trainer(rank, world, folder, method)[0] for method in (None, *SELECTORS)}
    half = DEFAULTS_STEPS // 2
    whole = _defaults_trainer(rank, world, folder, "random_block", save_steps=half)
    resumed = _defaults_trainer(rank, world, folder, "random_block", save_steps=half, resume=True)
    return runs, whole, resumed


def test_the_trainer_at_its_defaults_trains_under_every_selector_and_resumes_bitwise(tmp_path):
    """AdamW at 5e-5, clipping, a linear decay: each selector's logged loss falls by at least half of what
    dense training's falls (measured: 0.70 to 0.88 of it at density 0.01, in the density warm-up's first
    512 steps), and a resume at step 256 ends on the uninterrupted run's weights."""
    (runs, (_, weights, stats, _), (_, resumed, resumed_stats, step)) = run_distributed(
        _defaults_every_selector, 2, str(tmp_path), timeout=300)[0]
    dense = runs[None]
    dense_drop = dense[0] - sum(dense[-2:]) / 2
    assert dense_drop > 0.03, dense
    for method in SELECTORS:
        drop = runs[method][0] - sum(runs[method][-2:]) / 2
        assert drop > 0.5 * dense_drop, (method, runs[method], dense)
    assert stats["steps"] == resumed_stats["steps"] == DEFAULTS_STEPS
    assert step == DEFAULTS_STEPS // 2  # the resumed run took the second half's steps only
    assert torch.equal(resumed, weights)


def _scaler_handover(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddp_hooks import sparsify_hook
    from ddp_hooks.integrations.transformers import CommHookCallback
    from framework_jobs import new_state
    from small_mlp import small_mlp

    scaler = torch.amp.GradScaler("cpu")
    model, state = DDP(small_mlp()), new_state()
    CommHookCallback(lambda: model, state, sparsify_hook, grad_scaler=lambda: scaler).on_train_begin(
        None, SimpleNamespace(global_step=0), None)
    handed = state.grad_scaler is scaler
    other = new_state()
    other.grad_scaler = torch.amp.GradScaler("cpu")
    try:
        CommHookCallback(lambda: DDP(small_mlp()), other, sparsify_hook, grad_scaler=lambda: scaler).on_train_begin(
            None, SimpleNamespace(global_step=0), None)
        refusal = None
    except ValueError as error:
        refusal = str(error)
    return handed, refusal


def test_the_trainers_grad_scaler_reaches_the_hook_state_and_another_scaler_is_refused():
    handed, refusal = run_distributed(_scaler_handover, 1)[0]
    assert handed
    assert refusal is not None and "grad_scaler is not the Trainer's" in refusal


def test_register_comm_hook_reads_the_scaler_of_the_trainers_accelerator_and_follows_a_new_one(tmp_path):
    from transformers import Trainer, TrainingArguments

    from ddp_hooks import sparsify_hook
    from ddp_hooks.integrations.transformers import register_comm_hook
    from framework_jobs import new_state
    from small_mlp import small_mlp

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", disable_tqdm=True)
    trainer = Trainer(model=small_mlp(), args=args)
    state = new_state()
    callback = register_comm_hook(trainer, state, sparsify_hook)
    assert callback.grad_scaler() is None  # on the CPU the Accelerator scales nothing
    first, second = torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")
    trainer.accelerator.scaler = first  # what an fp16 run on a GPU has
    assert callback.grad_scaler() is first
    callback.hand_over_scaler()
    assert state.grad_scaler is first
    trainer.accelerator.scaler = second  # a new train() whose Accelerator holds another scaler
    callback.hand_over_scaler()
    assert state.grad_scaler is second

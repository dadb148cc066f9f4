"""The README's Hugging Face Trainer example, complete: `torchrun --standalone --nproc_per_node=2 recipes/trainer_quickstart.py`."""
import torch
import torch.nn.functional as F
from transformers import Trainer, TrainingArguments

from ddp_hooks import SparsifyState, sparsify_hook
from ddp_hooks.integrations.transformers import register_comm_hook


class Classifier(torch.nn.Module):  # yours, unchanged: returns its loss, as a transformers model does
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))

    def forward(self, inputs, labels):
        logits = self.net(inputs)
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


x = torch.randn(4096, 20, generator=torch.Generator().manual_seed(0))
data = [{"inputs": row, "labels": int(row[0] > 0)} for row in x]
args = TrainingArguments(output_dir="trainer-quickstart", use_cpu=True, num_train_epochs=3,
                         per_device_train_batch_size=32, learning_rate=1e-3,  # from scratch; AdamW, clipping: defaults
                         save_strategy="epoch", logging_strategy="epoch", report_to="none", disable_tqdm=True)
trainer = Trainer(model=Classifier(), args=args, train_dataset=data)

state = SparsifyState(method="shared_topk", density=0.01)  # under AdamW: see "Adam and AdamW" below
register_comm_hook(trainer, state, sparsify_hook)  # the one added call
trainer.train()  # trainer.train(resume_from_checkpoint=True) resumes every rank's hook state too
if trainer.is_world_process_zero():
    print(f"loss {trainer.state.log_history[-1]['train_loss']:.3f}; hook: {state.stats()}")

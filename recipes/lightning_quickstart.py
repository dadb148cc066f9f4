"""The README's Lightning example, complete: `torchrun --standalone --nproc_per_node=2 recipes/lightning_quickstart.py`."""
import lightning
import torch
import torch.nn.functional as F

from ddp_hooks import SparsifyState, sparsify_hook
from ddp_hooks.integrations.lightning import CommHook


class Classifier(lightning.LightningModule):  # yours, unchanged
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))

    def training_step(self, batch, batch_index):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


x = torch.randn(4096, 20, generator=torch.Generator().manual_seed(0))
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long()), batch_size=32)

state = SparsifyState(method="random_block", density=0.01)  # added: the hook's options
trainer = lightning.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=3, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False,
                            callbacks=[CommHook(state, sparsify_hook)])  # added: the callback
trainer.fit(Classifier(), loader)
trainer.save_checkpoint("lightning-quickstart.ckpt", weights_only=False)  # with every rank's hook state
if trainer.global_rank == 0:
    print(f"loss {trainer.callback_metrics['train_loss']:.3f}; hook: {state.stats()}")

"""The README's Accelerate example, complete: `torchrun --standalone --nproc_per_node=2 recipes/accelerate_quickstart.py`
(or `accelerate launch --num_processes 2 --cpu recipes/accelerate_quickstart.py`)."""
import torch
import torch.nn.functional as F
from accelerate import Accelerator

from ddp_hooks import SparsifyState, sparsify_hook
from ddp_hooks.integrations.accelerate import register_comm_hook

accelerator = Accelerator(cpu=True)  # cpu=True: this example runs on the CPU
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
x = torch.randn(4096, 20, generator=torch.Generator().manual_seed(0))
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long()), batch_size=32)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

state = SparsifyState(method="random_block", density=0.01)
register_comm_hook(accelerator, model, state, sparsify_hook)  # the one added call

for epoch in range(3):
    for inputs, labels in loader:
        loss = F.cross_entropy(model(inputs), labels)
        optimizer.zero_grad()
        accelerator.backward(loss)
        optimizer.step()
accelerator.save_state("accelerate-quickstart")  # every rank's hook state with the rest; load_state resumes it
accelerator.print(f"loss {loss.item():.3f}; hook: {state.stats()}")
accelerator.end_training()  # ends the process group before the interpreter exits

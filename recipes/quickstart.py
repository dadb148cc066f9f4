"""The README's quick start, complete: `torchrun --standalone --nproc_per_node=2 recipes/quickstart.py`."""
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ddp_hooks import SparsifyState, sparsify_hook

dist.init_process_group("gloo")  # "nccl" on GPUs; torchrun sets the rank and world size
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
ddp_model = DistributedDataParallel(model)
opt = torch.optim.SGD(ddp_model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)  # yours, unchanged

# The one added line: random-block at density 0.01 (1 % of the entries per layer per step, once the density
# warm-up has brought it down from 1: over 1000 steps by default, so this short run sends about half).
state = SparsifyState(method="random_block", density=0.01)
ddp_model.register_comm_hook(state, sparsify_hook)

data = torch.Generator().manual_seed(rank)  # each rank its own data
for step in range(300):
    x = torch.randn(32, 20, generator=data)
    y = (x[:, 0] > 0).long()
    loss = torch.nn.functional.cross_entropy(ddp_model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()

# Checkpoint: the hook's residuals differ per rank, so every rank saves its own file.
torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "hook": state.state_dict()},
           f"quickstart-rank{rank}.pt")
if rank == 0:
    print(f"loss {loss.item():.3f}; hook: {state.stats()}")
dist.destroy_process_group()

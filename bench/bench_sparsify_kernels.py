"""Compression work of one sparsify_hook call on a 25 MB bucket, beside the add_ floor.

Run: python -m pytest bench/bench_sparsify_kernels.py --benchmark-group-by=param:scope -p no:cacheprovider

The floor is ``residual.add_(grad)``: error feedback must read the gradient and
the residual once. Each method's row times what the hook does locally for one
bucket besides the collective: compensate, select, take the values, update the
residual, and write the averaged values back into the zeroed bucket buffer.
``extra_info`` records the bytes a rank would send.
"""

import pytest
import torch

from ddp_hooks.selection import Unit, budget, select

NUMEL = 25 * 2**20 // 4  # 25 MB of float32, PyTorch DDP's default bucket size
DENSITY = 0.01
# "layer" splits the bucket into 50 layers of equal size, like a mid-size CNN bucket
SCOPES = {"bucket": [Unit(0, 0, NUMEL)], "layer": [Unit(i, i * (NUMEL // 50), NUMEL // 50) for i in range(50)]}


@pytest.fixture(scope="module")
def tensors():
    torch.manual_seed(0)
    return torch.randn(NUMEL), torch.zeros(NUMEL)


def _hook_work(method, units, grad, residual, step):
    residual.add_(grad)
    idx = select(method, residual, units, DENSITY, seed=0, step=step)
    values = residual[idx]
    residual.index_fill_(0, idx, 0.0)
    grad.zero_()
    grad.index_copy_(0, idx, values)
    return idx.numel()


@pytest.mark.benchmark(group="sparsify-25MB")
def test_floor_add(benchmark, tensors):
    grad, residual = tensors
    benchmark.extra_info.update(bytes_sent=NUMEL * 4, density=1.0)
    benchmark.pedantic(residual.add_, args=(grad,), rounds=20, warmup_rounds=2)


@pytest.mark.benchmark(group="sparsify-25MB")
@pytest.mark.parametrize("scope", ["bucket", "layer"])
@pytest.mark.parametrize("method", ["random_block", "randomk", "topk"])
def test_hook_compression(benchmark, tensors, method, scope):
    grad, residual = tensors
    units = SCOPES[scope]
    k = sum(budget(u.numel, DENSITY) for u in units)
    benchmark.extra_info.update(bytes_sent=k * (8 if method == "topk" else 4), density=DENSITY)
    steps = iter(range(10**9))
    benchmark.pedantic(lambda: _hook_work(method, units, grad, residual, next(steps)), rounds=10, warmup_rounds=1)

"""One bucket's path stays short: the files of the package and the records one steady-state step goes through.

One step of DDP with the sparsifying hook (2 ranks, one bucket, momentum SGD
after 6 steps) is traced on every thread (``sys.setprofile`` and
``threading.setprofile``): the files of ``ddp_hooks`` in which a function
ran, and the classes of ``ddp_hooks`` that were constructed. A reader follows
a bucket through at most 8 files and 4 kinds of record.
"""

import os
import sys
import threading

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_hooks.testing import run_distributed

MAX_FILES, MAX_RECORDS = 8, 4
CASES = [("random_block", "allreduce"), ("topk", "allgather"), ("randomk", "allgather"), ("shared_topk", "allreduce")]


def _traced_step(rank, world, method, aggregation):
    import ddp_hooks

    root = os.path.dirname(ddp_hooks.__file__)
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)))
    state = ddp_hooks.SparsifyState(method=method, density=0.01, aggregation=aggregation, density_warmup_steps=0)
    model.register_comm_hook(state, ddp_hooks.sparsify_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    generator = torch.Generator().manual_seed(rank)

    def step():
        x, y = torch.randn(32, 64, generator=generator), torch.randint(0, 10, (32,), generator=generator)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    for _ in range(6):
        step()
    files, records, lock = set(), set(), threading.Lock()

    def profile(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        if code.co_name in ("__init__", "__new__") or (code.co_name == "<lambda>" and "_cls" in frame.f_locals):
            made = frame.f_locals.get("self", frame.f_locals.get("_cls", frame.f_locals.get("cls")))
            cls = made if isinstance(made, type) else type(made)
            if getattr(cls, "__module__", "").startswith("ddp_hooks"):
                with lock:
                    records.add(cls.__qualname__)
        if code.co_filename.startswith(root):
            with lock:
                files.add(os.path.relpath(code.co_filename, root))

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        step()
        torch.distributed.barrier()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return sorted(files), sorted(records)


@pytest.mark.parametrize("method,aggregation", CASES)
def test_a_steady_step_runs_in_few_files_and_records(method, aggregation):
    files, records = run_distributed(_traced_step, 2, method, aggregation)[0]
    assert "sparsify/hook.py" in files and "sparsify/compressor.py" in files  # (the tracer saw the hook)
    assert len(files) <= MAX_FILES, files
    assert len(records) <= MAX_RECORDS, records

"""No host syncs in the steady state: what a GPU would stall on, counted on the CPU, in the form a GPU takes.

A call that reads a tensor on the host (``.item()``, ``.tolist()``,
``bool()``/``int()``/``float()`` of a tensor, ``nonzero``, ``masked_select``,
``unique``, boolean-mask indexing, ``torch.equal``) or builds one from host
data (``torch.tensor``) drains a CUDA stream and leaves a bubble. Each is
counted in every thread (gloo's callback threads too) over a few steady-state
steps of DDP, with the sparsifying hook and, in the same process, with
PyTorch's ``allreduce_hook``; the hook may add none. Every branch of the hook
that depends on the device takes the form other devices take
(``compressor.HOST_READS_ON_CPU = False``; results into the bucket, not into a
vector kept at zero).
"""

import collections
import gc
import threading
import traceback

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_hooks import SparsifyState, sparsify_hook
from ddp_hooks.testing import run_distributed

TENSOR_METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "masked_select",
                  "unique")
TORCH_FUNCTIONS = ("nonzero", "masked_select", "unique", "tensor", "equal")
CONFIGS = [  # (label, SparsifyState options, optimizer momentum, grad scaler)
    ("random_block allreduce", dict(method="random_block"), 0.9, False),
    ("random_block allgather", dict(method="random_block", aggregation="allgather"), 0.9, False),
    ("randomk allreduce", dict(method="randomk"), 0.9, False),
    ("randomk allgather", dict(method="randomk", aggregation="allgather"), 0.9, False),
    ("topk allgather", dict(method="topk", aggregation="allgather"), 0.9, False),
    ("shared_topk allreduce", dict(method="shared_topk"), 0.9, False),
    ("random_block bucket scope", dict(method="random_block", scope="bucket"), 0.9, False),
    ("topk global scope", dict(method="topk", aggregation="allgather", scope="global"), 0.9, False),
    ("random_block, hook's momentum and decay, float16 values",
     dict(method="random_block", momentum=0.9, weight_decay=1e-4, value_dtype="float16"), 0.0, False),
    ("topk, grad scaler", dict(method="topk", aggregation="allgather"), 0.9, True),
    # dense inside a node of both ranks: reduce-scatter, the node's verdict, all-gather
    ("random_block, nodes", dict(method="random_block", nodes=2), 0.9, False),
    ("topk global scope, nodes, grad scaler", dict(method="topk", aggregation="allgather", scope="global", nodes=2),
     0.9, True),
]
WARM_STEPS, COUNTED_STEPS = 3, 3


class HostReads:
    """Counts host-blocking calls in every thread while :attr:`active`, with where each kind was first made."""

    def __init__(self):
        self.active = False
        self.counts = collections.Counter()
        self.first_seen = {}
        self._lock = threading.Lock()
        self._restore = []

    def _note(self, name):
        if not self.active:
            return
        with self._lock:
            self.counts[name] += 1
            if name not in self.first_seen:
                frames = [f for f in traceback.extract_stack()[:-2] if "ddp_hooks" in f.filename]
                self.first_seen[name] = " <- ".join(f"{f.filename.split('ddp_hooks/')[-1]}:{f.lineno}"
                                                    for f in reversed(frames[-3:]))

    def _wrap(self, owner, name, counted=None):
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            if counted is None or counted(args):
                self._note(name)
            return original(*args, **kwargs)

        setattr(owner, name, wrapper)
        self._restore.append((owner, name, original))

    def install(self):
        for name in TENSOR_METHODS:
            self._wrap(torch.Tensor, name)
        for name in TORCH_FUNCTIONS:
            self._wrap(torch, name)

        def bool_mask(args):
            index = args[1] if len(args) > 1 else None
            items = index if isinstance(index, tuple) else (index,)
            return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)

        self._wrap(torch.Tensor, "__getitem__", bool_mask)
        return self

    def uninstall(self):
        for owner, name, original in reversed(self._restore):
            setattr(owner, name, original)


def _model():
    torch.manual_seed(0)  # the same weights on every rank; two buckets
    return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 10))


def _host_reads(hook, state, momentum, scaler, counter, rank):
    model = DDP(_model(), bucket_cap_mb=0.25)
    buckets = set()

    def counting_buckets(state, bucket):
        buckets.add(bucket.index())
        return hook(state, bucket)

    model.register_comm_hook(state, counting_buckets)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=momentum)
    generator = torch.Generator().manual_seed(rank)

    def step():
        x, y = torch.randn(16, 32, generator=generator), torch.randint(0, 10, (16,), generator=generator)
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()

    for _ in range(WARM_STEPS):
        step()
    counter.counts.clear()
    counter.active = True
    try:
        for _ in range(COUNTED_STEPS):
            step()
    finally:
        counter.active = False
    return dict(counter.counts), len(buckets)


def _per_config(rank, world):
    from ddp_hooks.sparsify import compressor, memory

    compressor.HOST_READS_ON_CPU = False  # every device-dependent branch in the form a GPU takes
    memory.SparseOutputs.for_bucket = lambda self, *args: None  # results into the bucket, as on a GPU
    counter = HostReads().install()
    rows = []
    try:
        for label, options, momentum, scaled in CONFIGS:
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4) if scaled else None
            base, buckets = _host_reads(allreduce_hook, None, momentum, scaler, counter, rank)
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4) if scaled else None
            state = SparsifyState(density=0.05, density_warmup_steps=0, grad_scaler=scaler, **options)
            hooked, _ = _host_reads(sparsify_hook, state, momentum, scaler, counter, rank)
            extra = {name: hooked.get(name, 0) - base.get(name, 0) for name in set(hooked) | set(base)}
            rows.append((label, buckets, {k: v for k, v in extra.items() if v},
                         {k: counter.first_seen.get(k) for k, v in extra.items() if v > 0}))
            counter.first_seen.clear()
            del state
            gc.collect()  # a state outliving its model would take the next model's parameters (reused ids) for its own
    finally:
        counter.uninstall()
    return rows


def test_the_hook_reads_nothing_on_the_host_in_the_steady_state():
    for rank_rows in run_distributed(_per_config, 2, timeout=300):
        for label, buckets, extra, where in rank_rows:
            assert buckets >= 2, label  # the model spans several buckets
            per_bucket_step = sum(extra.values()) / (buckets * COUNTED_STEPS)
            assert per_bucket_step == 0, f"{label}: {per_bucket_step:.1f} host syncs per bucket per step {extra}, at {where}"


def test_the_counter_counts_every_kind_in_every_thread():
    """The counter itself: each kind of call, from the main thread and from another one."""
    counter = HostReads().install()
    try:
        counter.active = True
        t = torch.tensor([1.0, 0.0, 2.0])

        def reads():
            t.item() if t.numel() == 1 else t[0].item()
            t.tolist()
            bool(t[0])
            int(t[0])
            float(t[0])
            t.nonzero()
            torch.masked_select(t, t > 0)
            t.unique()
            t[t > 0]
            torch.equal(t, t)

        reads()
        other = threading.Thread(target=reads)
        other.start()
        other.join()
        t[torch.tensor([0, 2])]  # an index tensor of ints is no mask: not counted
    finally:
        counter.active = False
        counter.uninstall()
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "nonzero", "masked_select", "unique",
                 "__getitem__", "equal"):
        assert counter.counts[name] >= 2, (name, counter.counts)
    assert counter.counts["__getitem__"] == 2
    assert torch.Tensor.item is not None and "wrapper" not in torch.Tensor.item.__qualname__  # restored


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q"])

"""The sparsify hook's own work on one bucket, beside the add_ floor and a plain copy (pytest-benchmark).

Run (about 20 s on 2 cores)::

    python -m pytest bench/bench_sparsify_kernels.py -p no:cacheprovider

Each row runs what :func:`ddp_hooks.sparsify_hook` does for one bucket at
world size 1, through the compressor's stages (:mod:`ddp_hooks.sparsify.compressor`):
the finiteness scan, compensation, selection, packing, then the verdict, the
residual update and the write of the averaged values into the result vector
the hook returns on the CPU, kept at zero between steps
(:class:`ddp_hooks.sparsify.memory.SparseOutputs`; elsewhere the hook zeroes
the bucket and writes there: ``bench/compare_result_paths.py`` times both,
interleaved). Only the collective is absent: at world size 1 the average is
the rank's own values, and the compressor's collectives are replaced by ones
that complete at once (gloo's would add some 40 microseconds per call).

Groups are per bucket size and density (a row at density 1, which sends
every entry, sits with the 25 MB rows at density 0.01). ``floor`` is ``residual.add_(grad)``
(error feedback must read the gradient and the residual once), ``copy`` a
plain ``dst.copy_(grad)``, ``scan`` the hook's search for inf/NaN and for
parameters without a gradient on its own (a part of every hook row). Each
hook row and the scan also time the floor before every one of their rounds,
on tensors of their own: rows run one after the other, and this machine's
memory speed drifts by 20 % and more in between. The summary at the end
prints each row's minimum time over that interleaved floor's minimum
(``x floor``) and over the floor row's (``x row``). ``extra_info`` holds the
bytes a rank sends per call (values, plus int32 positions for top-k) and the
density.
"""

import contextlib
import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

from ddp_hooks import SparsifyState
from ddp_hooks.sparsify import SparsifyOptions
from ddp_hooks.sparsify.hook import scan
from ddp_hooks.sparsify.selectors import Unit, budgets
from ddp_hooks.sparsify.selectors.shared_topk import leaders
from ddp_hooks.sparsify.selectors.topk import topk_units

SIZES_MB = (1, 25)
DENSITIES = (0.01, 0.1)
# One thread for every row: the floor and the hook's many small operations compare per core
# (with DDP on the CPU each rank gets a share of the cores anyway).
torch.set_num_threads(1)
ROUNDS = 15
LAYERS = 50  # "layer" scope: the bucket holds 50 equal layers, like a mid-size CNN's bucket
CONFIGS = [("random_block", "bucket", "allreduce"), ("random_block", "layer", "allreduce"),
           ("randomk", "bucket", "allreduce"), ("randomk", "layer", "allreduce"),
           ("topk", "bucket", "allgather"), ("topk", "layer", "allgather"),
           # at world size 1 the rank leads every unit: all of top-k's selection (test_selection: per rank at 4)
           ("shared_topk", "layer", "allreduce")]


def _group(mb, density):
    return f"{mb}MB-d{density}"


class _Arrived:
    """A collective of one process that has finished: its output already holds the result."""

    def __init__(self, output):
        self._future = torch.futures.Future()
        self._future.set_result([output])

    def get_future(self):
        return self._future

    def wait(self, timeout=None):
        return True


def _all_gather_of_one(output, tensor, group=None, async_op=False):
    output.copy_(tensor)
    return _Arrived(output)


@contextlib.contextmanager
def instant_collectives():
    """A gloo group of one process whose collectives complete at once: the rows time the compressor's own work."""
    collectives = {"all_reduce": lambda tensor, op=None, group=None, async_op=False: _Arrived(tensor),
                   "all_gather_single": _all_gather_of_one, "all_gather_into_tensor": _all_gather_of_one}
    real = {name: getattr(dist, name, None) for name in collectives}
    for name, collective in collectives.items():
        setattr(dist, name, collective)
    initialized = dist.is_initialized()
    with tempfile.TemporaryDirectory() as folder:
        if not initialized:
            dist.init_process_group("gloo", init_method=f"file://{os.path.join(folder, 'store')}", rank=0,
                                    world_size=1)
        try:
            yield
        finally:
            if not initialized:
                dist.destroy_process_group()
            for name, collective in real.items():
                if collective is not None:
                    setattr(dist, name, collective)


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    with instant_collectives():
        yield


class KernelBucket:
    """A flat gradient, its residual and layout, and a SparsifyState bound to a world of one."""

    def __init__(self, mb, density, method, scope, aggregation, into_bucket=False,
                 block_size=SparsifyOptions.block_size):
        numel = mb * 2**20 // 4
        per_layer = numel // LAYERS
        numel = per_layer * LAYERS
        torch.manual_seed(0)
        self.source = torch.randn(numel)
        self.grad = torch.empty(numel)
        self.views = list(self.grad.split(per_layer))
        self.starts = torch.arange(0, numel, per_layer)
        self.layout = tuple((i, i * per_layer, per_layer) for i in range(LAYERS))
        if scope == "layer":
            self.units = tuple(Unit(i, i * per_layer, per_layer) for i in range(LAYERS))
        else:
            self.units = (Unit(0, 0, numel),)
        self.state = SparsifyState(method=method, density=density, scope=scope, aggregation=aggregation,
                                   density_warmup_steps=0, block_size=block_size)  # the steady state
        self.into_bucket = into_bucket  # write into the zeroed bucket (GPUs, gradient_as_bucket_view=True)

    def refill(self):
        self.grad.copy_(self.source)

    @property
    def residual(self):
        return self.state.residuals.flat(0)

    def hook_work(self):
        state, compressor = self.state, self.state.compressor
        marks = scan(self.grad, self.views, self.starts)
        pending = compressor.begin(self.grad, self.units, self.starts, marks, key=0, layout=self.layout, group=None,
                                   step=state.step, density=state.density_at(state.step))
        compressor.send(pending)
        bad, parts = compressor.unpack(pending)
        discard = torch.stack([bad]).any()  # the step's one verdict
        state.nonfinite.add(discard)
        output = target = None
        if not self.into_bucket:  # as the hook on the CPU with float32 gradients
            output = state.results.for_bucket(0, self.grad, self.views, [])
            target = output.overwrite() if pending.dense else output.clear()
        written = compressor.finish(pending, parts, discard=discard, target=target)
        if output is not None:
            output.written = written
        state.step += 1


@pytest.mark.parametrize("baseline", ["floor", "copy"])
@pytest.mark.parametrize("density", DENSITIES)
@pytest.mark.parametrize("mb", SIZES_MB)
def test_baseline(benchmark, mb, density, baseline):
    """``floor``: ``residual.add_(grad)``; ``copy``: ``dst.copy_(grad)``."""
    benchmark.group = _group(mb, density)
    grad, other = torch.randn(mb * 2**20 // 4), torch.zeros(mb * 2**20 // 4)
    benchmark.extra_info.update(bytes_sent=grad.numel() * 4, density=1.0)
    benchmark.pedantic(other.add_ if baseline == "floor" else other.copy_, args=(grad,), rounds=20, warmup_rounds=2)
    del grad, other


def _run_with_own_floor(benchmark, work, refill, numel):
    """Time ``work`` after ``refill``, and the floor once before each round, on tensors of the row's own.

    The row's ratio then compares times taken no more than a round apart
    (rows run one after the other, and this machine's memory speed drifts by
    20 % and more between them).
    """
    residual, grad = torch.zeros(numel), torch.randn(numel)
    floor_times = []

    def floor_then_refill():
        start = time.perf_counter()
        residual.add_(grad)
        floor_times.append(time.perf_counter() - start)
        refill()

    benchmark.pedantic(work, setup=floor_then_refill, rounds=ROUNDS, warmup_rounds=1)
    benchmark.extra_info["own_floor_min_s"] = min(floor_times)
    for tensor in (residual, grad):  # pytest-benchmark keeps the setup function: free its tensors' memory now
        tensor.set_()


@pytest.mark.parametrize("config", CONFIGS, ids=["-".join(c) for c in CONFIGS])
@pytest.mark.parametrize("density", DENSITIES)
@pytest.mark.parametrize("mb", SIZES_MB)
def test_hook(benchmark, mb, density, config):
    benchmark.group = _group(mb, density)
    bucket = KernelBucket(mb, density, *config)
    bucket.refill()
    bucket.hook_work()  # first call: caches (layout tensors) and allocations
    sent = bucket.state.stats()["bytes_sent"]
    benchmark.extra_info.update(bytes_sent=sent, density=density)
    _run_with_own_floor(benchmark, bucket.hook_work, bucket.refill, bucket.grad.numel())
    assert torch.isfinite(bucket.residual).all()
    # pytest-benchmark keeps the benchmarked callable until the session ends; release the buffers now,
    # or later rows run beside gigabytes of dead buckets (and measurably slower)
    vars(bucket).clear()


@pytest.mark.parametrize("block_size", [1, 16, 64, 1 << 30], ids=[f"25-0.01-random_block-layer-{b}" for b in
                                                                    ("b1", "b16", "b64", "one_block")])
def test_random_block_sizes(benchmark, block_size):
    """random_block, layer scope, 25 MB at density 0.01, with other block sizes than the default (4)."""
    benchmark.group = _group(25, 0.01)
    bucket = KernelBucket(25, 0.01, "random_block", "layer", "allreduce", block_size=block_size)
    bucket.refill()
    bucket.hook_work()
    benchmark.extra_info.update(bytes_sent=bucket.state.stats()["bytes_sent"], density=0.01)
    _run_with_own_floor(benchmark, bucket.hook_work, bucket.refill, bucket.grad.numel())
    vars(bucket).clear()


@pytest.mark.parametrize("label", ["25-1-d1-topk-layer-sends-everything"])
def test_sends_everything(benchmark, label):
    """top-k at density 1, layer scope, 25 MB: every entry sent by AllReduce (as in its AllGather crossover).

    The positions are every position in order, so gathers and scatters
    there are copies (:mod:`ddp_hooks.sparsify.memory`); grouped with
    the 25 MB rows at density 0.01 for their floor.
    """
    benchmark.group = _group(25, 0.01)
    bucket = KernelBucket(25, 1.0, "topk", "layer", "allgather")
    bucket.refill()
    bucket.hook_work()
    benchmark.extra_info.update(bytes_sent=bucket.state.stats()["bytes_sent"], density=1.0)
    _run_with_own_floor(benchmark, bucket.hook_work, bucket.refill, bucket.grad.numel())
    vars(bucket).clear()


@pytest.mark.parametrize("dead_first", [False, True], ids=["scan", "scan-first-entries-zero"])
@pytest.mark.parametrize("density", DENSITIES)
@pytest.mark.parametrize("mb", SIZES_MB)
def test_scan(benchmark, mb, density, dead_first):
    """The finiteness and idle scan alone (part of every hook row): one read of the gradient.

    ``first-entries-zero``: every layer's first entry is zero, as where a
    weight matrix's first input feature is dead (a border pixel after ReLU
    and pooling, a token not in the batch), so that a scan that looked only
    there would read every layer whole to tell it from an unused one.
    """
    benchmark.group = _group(mb, density)
    bucket = KernelBucket(mb, density, "random_block", "layer", "allreduce")
    if dead_first:
        bucket.source[bucket.starts] = 0.0
    bucket.refill()
    _run_with_own_floor(benchmark, lambda: scan(bucket.grad, bucket.views, bucket.starts), bucket.refill,
                        bucket.grad.numel())
    vars(bucket).clear()


@pytest.mark.parametrize("selector", ["topk", "shared_topk-per-rank-w4"])
@pytest.mark.parametrize("density", DENSITIES)
@pytest.mark.parametrize("mb", SIZES_MB)
def test_selection(benchmark, mb, density, selector):
    """Selection alone over 4 steps, layer scope, from |p|: top-k of every layer, or one rank's share at 4 ranks.

    ``shared_topk-per-rank-w4``: at each of 4 steps rank 0 selects the
    layers it leads (``leaders``), so the rotation is averaged over. The
    positions' broadcasts are collectives, absent here as in every row.
    """
    benchmark.group = _group(mb, density)
    bucket = KernelBucket(mb, density, "topk", "layer", "allgather")
    bucket.refill()
    magnitude = bucket.grad.abs()
    mask = torch.empty((magnitude.numel() + 7) // 8 * 8, dtype=torch.bool)
    units = bucket.units
    ks = budgets(units, density)
    if selector == "topk":  # four steps, as the other row
        shares = [list(range(len(units)))] * 4
    else:
        keys, sizes = [u.key for u in units], [u.numel for u in units]
        shares = [[i for i, leader in enumerate(leaders(keys, sizes, step, 4)) if leader == 0] for step in range(4)]

    def select():
        for share in shares:
            topk_units(magnitude, [units[i].offset for i in share], [units[i].numel for i in share],
                       [ks[i] for i in share], mask)

    benchmark.extra_info.update(bytes_sent=0, density=density, steps_per_call=len(shares))
    _run_with_own_floor(benchmark, select, lambda: None, bucket.grad.numel())
    vars(bucket).clear()

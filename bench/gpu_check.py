"""One-GPU check of the sparsifying hook: residuals on the GPU, no host traffic, kernel times.

Run on a machine with one CUDA device (about a minute)::

    python bench/gpu_check.py

or, as a smoke run of the same code anywhere (no CUDA-specific checks)::

    python bench/gpu_check.py --device cpu --steps 2

It trains a DDP model (one process, NCCL on CUDA, gloo on CPU) with
:func:`ddp_hooks.sparsify_hook` for every method, scope and aggregation, and
for each configuration reports, from the real hook calls during ``backward``:

* ``hook ms``: device time of one hook call on a 25 MB bucket (CUDA events
  around the call; the call enqueues all its work), median over the steps;
* ``x copy``, ``x add``: that time over a device-to-device copy of the same
  buffer and over the in-place ``add_`` floor of error feedback;
* ``syncs``: synchronising CUDA operations inside the hook, per call, as
  ``torch.cuda.set_sync_debug_mode`` reports them: ``.item()``, ``nonzero``,
  and every blocking copy between host and device (``torch.tensor(list,
  device="cuda")`` and ``.tolist()`` among them);
* ``residual``: the device and dtype of every error-feedback residual.

With one process the collective is skipped (the hook's world-size-1 path),
so the times are the hook's own compression and decompression work.
Random-block needs no synchronisation and no host copy; top-k and random-k
read a count back to size their output (``nonzero``), which costs one or
two synchronisations each.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ddp_hooks import SparsifyState, sparsify_hook  # noqa: E402

BUCKET_MB = 25
CONFIGS = [  # (method, scope, aggregation)
    ("random_block", "layer", "allreduce"), ("random_block", "bucket", "allreduce"),
    ("random_block", "global", "allreduce"), ("random_block", "layer", "allgather"),
    ("randomk", "layer", "allreduce"), ("randomk", "bucket", "allgather"),
    ("topk", "layer", "allgather"), ("topk", "bucket", "allgather"), ("topk", "global", "allgather"),
]


def _model(device: torch.device) -> torch.nn.Module:
    """50 square layers of about 0.5 MB each: one 25 MB bucket of 50 layers."""
    side = int((BUCKET_MB * 2**20 / 4 / 50) ** 0.5)
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(side, side, bias=False) for _ in range(50)]).to(device)


class _Probe:
    """Wraps the hook: times each call on the device and counts the synchronising operations in it."""

    def __init__(self, device: torch.device):
        self.device = device
        self.calls = []  # (start event, end event) on CUDA, seconds on the CPU
        self.syncs = 0

    def hook(self, state, bucket):
        if self.device.type != "cuda":
            t0 = time.perf_counter()
            fut = sparsify_hook(state, bucket)
            self.calls.append(time.perf_counter() - t0)
            return fut
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fut = sparsify_hook(state, bucket)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        end.record()
        self.syncs += sum("synchroniz" in str(w.message) for w in caught)
        self.calls.append((start, end))
        return fut

    def milliseconds(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            return [s.elapsed_time(e) for s, e in self.calls]
        return [1e3 * t for t in self.calls]


def _baseline(device: torch.device, numel: int, reps: int = 20):
    """Median ms of a device-to-device copy and of the add_ floor on a bucket-sized buffer."""
    src, dst = torch.randn(numel, device=device), torch.zeros(numel, device=device)
    out = {}
    for name, fn in (("copy", lambda: dst.copy_(src)), ("add", lambda: dst.add_(src))):
        times = []
        for _ in range(reps + 2):
            if device.type == "cuda":
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                fn()
                e.record()
                torch.cuda.synchronize()
                times.append(s.elapsed_time(e))
            else:
                t0 = time.perf_counter()
                fn()
                times.append(1e3 * (time.perf_counter() - t0))
        out[name] = statistics.median(times[2:])
    return out


def check(config, device: torch.device, steps: int, density: float):
    method, scope, aggregation = config
    model = DDP(_model(device), bucket_cap_mb=BUCKET_MB + 1)
    state = SparsifyState(method=method, density=density, scope=scope, aggregation=aggregation,
                              density_warmup_steps=0)  # the steady state
    probe = _Probe(device)
    model.register_comm_hook(state, probe.hook)
    x = torch.randn(32, model.module[0].in_features, device=device)
    for step in range(steps + 2):  # two steps before measuring: DDP rebuilds its buckets after the first
        if step == 2:
            probe.calls.clear()
            probe.syncs = 0
        model(x).square().mean().backward()
        model.zero_grad(set_to_none=False)
    calls = len(probe.calls)
    ms = probe.milliseconds()
    residuals = {(str(t.device), str(t.dtype).replace("torch.", "")) for t in state.residuals._flat.values()}
    finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
    return {
        "hook_ms": statistics.median(ms) * calls / max(1, steps), "syncs": probe.syncs / max(1, calls),
        "residual": ", ".join(f"{d} {t}" for d, t in sorted(residuals)), "finite": finite,
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="default: cuda")
    p.add_argument("--steps", type=int, default=10, help="measured steps per configuration (default 10)")
    p.add_argument("--density", type=float, default=0.01, help="default 0.01")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device here; run with --device cpu for a smoke run")
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = os.path.join(tempfile.mkdtemp(), "store")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{store}",
                            rank=0, world_size=1)
    try:
        numel = sum(p.numel() for p in _model(device).parameters())
        base = _baseline(device, numel)
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        print(f"{name}, torch {torch.__version__}, bucket {numel * 4 / 2**20:.1f} MB in 50 layers, "
              f"density {args.density}, {args.steps} steps; copy {base['copy']:.3f} ms, add_ {base['add']:.3f} ms")
        print("| method | scope | aggregation | hook ms | x copy | x add | syncs | residual | finite |")
        print("|---|---|---|---|---|---|---|---|---|")
        failures = 0
        for config in CONFIGS:
            try:
                r = check(config, device, args.steps, args.density)
            except Exception as exc:  # report and go on: one broken configuration must not hide the others
                failures += 1
                print(f"| {' | '.join(config)} | FAILED: {type(exc).__name__}: {exc} |")
                continue
            ok_residual = all(d.startswith(device.type) and d.endswith("float32") for d in r["residual"].split(", "))
            failures += not (ok_residual and r["finite"])
            print(f"| {' | '.join(config)} | {r['hook_ms']:.3f} | {r['hook_ms'] / base['copy']:.2f} | "
                  f"{r['hook_ms'] / base['add']:.2f} | {r['syncs']:.1f} | "
                  f"{r['residual']} | {r['finite']} |")
        print("all checks passed" if failures == 0 else f"{failures} configuration(s) FAILED")
        return failures
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())

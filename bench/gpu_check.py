"""The one-GPU check of the sparsifying hook: DDP + ``sparsify_hook`` + momentum SGD on CUDA/NCCL, as users run it.

Run it on a machine with one CUDA device (about 2 to 4 minutes; ``--minutes`` caps the total)::

    python bench/gpu_check.py                          # every check
    python bench/gpu_check.py --only bitwise timing    # some of them
    python bench/gpu_check.py --dry-run                # the script itself, on the CPU (gloo), in seconds

One process, world size 1, a real NCCL group. Each check, and what it proves:

* ``collectives``: every configuration's steps are counted through wrappers of ``torch.distributed.all_reduce``,
  ``all_gather_single`` (``all_gather_into_tensor`` before torch 2.14) and ``broadcast``. A compressed step
  (density below 1) that issued none FAILS: at world size 1 the hook would then never exercise its
  collective path, and the checks below would prove nothing about it.
* ``bitwise``: a model whose gradients are bitwise the same on any device (loss ``sum_i <p_i, c_i>`` with
  per-step ``c_i`` drawn on the CPU, so ``grad p_i = c_i``; a ResNet-18-like list of parameter shapes in
  several buckets) trains for a few steps with the hook and ``SGD(lr=0.1, momentum=0.9)``. Every collective
  first waits, on a side stream, for a ~50 ms sleep kernel that the caller's stream does not wait for, so a
  result read without the future's stream semantics (``then()``/``wait()``) would be stale. Every step's
  averaged gradient and the final parameters must equal a CPU/gloo run of the same seeds (a child process)
  bit for bit; the first mismatch is printed (configuration, step, layer, max abs diff).
* ``sync``: after 3 steps, 2 steps under ``torch.cuda.set_sync_debug_mode("error")``: the hook may not
  synchronise the host. PyTorch's ``allreduce_hook`` runs first as the control: if it fails, DDP synced.
* ``sanitizer``: one short run per method in a child with ``TORCH_CUDA_SANITIZER=1`` (CSAN: data races
  between streams), the control included.
* ``timing``: median ms per step of DDP on ResNet-18 and ResNet-50 (synthetic data, batch 32 at 224x224)
  with ``allreduce_hook``, PowerSGD rank 4 and the sparsifying hook at density 0.01, and the ratio to
  ``allreduce_hook`` (no injected delay).

``--dry-run`` runs the same code with gloo on the CPU, tiny sizes and 3 steps: bitwise against a second CPU
run, counted collectives, the timing table on a tiny CNN; it skips only what needs CUDA (the delay kernel,
sync debug mode, the sanitizer). The last lines are a summary, one line per check (PASS, FAIL or
SKIPPED); the exit status is 1 if any check failed.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ddp_hooks import SparsifyState, sparsify_hook  # noqa: E402

CHECKS = ("collectives", "bitwise", "sync", "sanitizer", "timing")
CONTROL = "allreduce_hook"  # PyTorch's own hook, run beside the sparsifier's configurations as the control
DENSITY = 0.05
GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"


class Size(NamedTuple):
    width: int  # channels of the ResNet-18-like shapes' first stage
    steps: int
    sleep_ms: float  # the delay before each collective (CUDA only)
    timing_models: tuple
    warm_steps: int  # timing: untimed steps (DDP rebuilds its buckets after the first; PowerSGD starts at 2)
    timed_steps: int


CUDA_SIZE = Size(width=12, steps=8, sleep_ms=50.0, timing_models=("resnet18", "resnet50"), warm_steps=5,
                 timed_steps=20)  # width 12: 397k entries, the largest layer above shared_topk's 2**16
DRY_SIZE = Size(width=2, steps=3, sleep_ms=0.0, timing_models=("tiny-cnn",), warm_steps=3, timed_steps=2)


@dataclass(frozen=True)
class Config:
    method: str  # a selector, or CONTROL
    scope: str = "layer"
    aggregation: str = "allreduce"
    value_dtype: Optional[str] = None
    density_warmup_steps: int = 0

    @property
    def label(self) -> str:
        if self.method == CONTROL:
            return CONTROL
        extra = (f" {self.value_dtype}" if self.value_dtype else "") + (
            f" warm-up {self.density_warmup_steps}" if self.density_warmup_steps else "")
        return f"{self.method}/{self.scope}/{self.aggregation}{extra}"

    def hook(self):
        """``(state, hook)`` to register; a new state each time."""
        if self.method == CONTROL:
            return None, default_hooks.allreduce_hook
        state = SparsifyState(method=self.method, density=DENSITY, scope=self.scope, aggregation=self.aggregation,
                              density_warmup_steps=self.density_warmup_steps, value_dtype=self.value_dtype)
        return state, sparsify_hook


def configurations():
    """The control, then every method x aggregation x scope, half values for two, the density warm-up for four."""
    out = [Config(CONTROL)]
    for method, aggregations in (("random_block", ("allreduce", "allgather")), ("randomk", ("allreduce", "allgather")),
                                 ("topk", ("allgather",)), ("shared_topk", ("allreduce",))):
        out += [Config(method, scope, agg) for agg in aggregations for scope in ("layer", "bucket", "global")]
    out += [Config("random_block", "layer", "allreduce", "float16"), Config("topk", "bucket", "allgather", "float16")]
    out += [Config("random_block", "layer", "allreduce", density_warmup_steps=4),
            Config("randomk", "bucket", "allgather", density_warmup_steps=4),
            Config("topk", "global", "allgather", density_warmup_steps=4),
            Config("shared_topk", "layer", "allreduce", density_warmup_steps=4)]
    return out


# ----- a model whose gradients are the same bits on every device -----

def layer_shapes(width: int):
    """ResNet-18's parameter shapes (conv, then BN weight and bias) with ``width`` channels in its first stage."""
    shapes, c_in = [(width, 3, 7, 7), (width,), (width,)], width
    for c in (width, 2 * width, 4 * width, 8 * width):
        for block in range(2):
            shapes += [(c, c_in if block == 0 else c, 3, 3), (c,), (c,), (c, c, 3, 3), (c,), (c,)]
            if block == 0 and c != c_in:  # the downsampling shortcut
                shapes += [(c, c_in, 1, 1), (c,), (c,)]
        c_in = c
    return shapes + [(10, 8 * width), (10,)]


class ExactGrads(torch.nn.Module):
    """Parameters of the given shapes whose loss is ``sum_i <p_i, c_i>``: each gradient is exactly its ``c_i``."""

    def __init__(self, shapes):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.weights = torch.nn.ParameterList([torch.nn.Parameter(0.1 * torch.randn(s, generator=g)) for s in shapes])

    def forward(self, coefs):
        return sum((p * c).sum() for p, c in zip(self.weights, coefs))


def coefficients(shapes, steps: int, device: torch.device):
    """Each step's ``c_i``, drawn on the CPU from a seeded generator (the same bits for every device)."""
    g = torch.Generator().manual_seed(1)
    return [[torch.randn(s, generator=g).to(device) for s in shapes] for _ in range(steps)]


# ----- the collectives: counted, and delayed on CUDA -----

class Collectives:
    """While active, counts the collectives issued through ``torch.distributed``; with ``sleep_cycles`` on CUDA,
    delays each on its communication stream only.

    The collective is launched from a side stream that first waits for the caller's stream, then sleeps: NCCL's
    stream waits for the side stream, the caller's stream does not. The work's future carries NCCL's stream
    events, so ``then()`` callbacks and ``wait()`` see the result; a ``value()`` read on the caller's stream
    without them reads the buffer ~50 ms before NCCL writes it.
    """

    def __init__(self, sleep_cycles: int = 0):
        self.calls, self.sleep_cycles, self._real = 0, sleep_cycles, {}

    def __enter__(self):
        for name in ("all_reduce", GATHER, "broadcast"):
            self._real[name] = getattr(dist, name)
            setattr(dist, name, self._wrap(self._real[name]))  # the hooks look them up at call time
        return self

    def __exit__(self, *exc):
        for name, real in self._real.items():
            setattr(dist, name, real)

    def _wrap(self, real):
        @functools.wraps(real)
        def collective(*args, **kwargs):
            self.calls += 1
            tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
            if not self.sleep_cycles or not tensors or not tensors[0].is_cuda:
                return real(*args, **kwargs)
            side = torch.cuda.Stream(device=tensors[0].device)
            side.wait_stream(torch.cuda.current_stream(tensors[0].device))
            for t in tensors:  # the caching allocator may not reuse them before the side stream's work is done
                t.record_stream(side)
            with torch.cuda.stream(side):
                torch.cuda._sleep(self.sleep_cycles)
                return real(*args, **kwargs)

        return collective


def sleep_cycles(ms: float) -> int:
    """The ``torch.cuda._sleep`` argument that sleeps about ``ms`` milliseconds on this GPU."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return int(10_000_000 / start.elapsed_time(end) * ms)


@contextlib.contextmanager
def sync_debug(on: bool):
    if not on:
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def train(config: Config, device: torch.device, size: Size, counter: Optional[Collectives] = None,
          steps: Optional[int] = None, sync_steps=()):
    """DDP + the configuration's hook + momentum SGD for ``steps``; each step's ``p.grad``, the final parameters,
    the collectives per step (``counter``) and each step's density, all on the CPU."""
    steps = size.steps if steps is None else steps
    shapes = layer_shapes(size.width)
    bucket_mb = sum(math.prod(s) for s in shapes) * 4 / 2**20 / 5  # about 5 buckets
    model = DDP(ExactGrads(shapes).to(device), device_ids=[device.index] if device.type == "cuda" else None,
                bucket_cap_mb=bucket_mb)
    state, hook = config.hook()
    model.register_comm_hook(state, hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    coefs = coefficients(shapes, steps, device)  # on the device before any step: no copy in a sync-debug step
    grads, counts = [], []
    for step in range(steps):
        before = counter.calls if counter else 0
        with sync_debug(step in sync_steps):
            model(coefs[step]).backward()
            grads.append([p.grad.detach().clone() for p in model.parameters()])  # kept on the device: no sync
            optimizer.step()
            optimizer.zero_grad()
        counts.append((counter.calls if counter else 0) - before)
    densities = [1.0 if state is None else state.density_at(s) for s in range(steps)]
    return {"grads": [[g.cpu() for g in step] for step in grads], "params": [p.detach().cpu() for p in
            model.parameters()], "counts": counts, "densities": densities}


def first_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text.splitlines()[0][:200]


# ----- the checks -----

def run_configurations(device, size: Size, cycles: int):
    """Every configuration under counted (and on CUDA delayed) collectives: label -> run, or its error's text."""
    runs = {}
    with Collectives(cycles) as counter:
        for config in configurations():
            try:
                runs[config.label] = train(config, device, size, counter)
            except Exception as exc:  # report it and go on: one broken configuration must not hide the others
                runs[config.label] = first_line(exc)
    return runs


def check_collectives(runs):
    print("\n-- collectives per step (world size 1) --")
    silent = []
    for label, run in runs.items():
        if isinstance(run, str):
            print(f"  {label:<42} FAIL: {run}")
            silent.append(label)
            continue
        counts = run["counts"]
        text = f"{counts[0]} each step" if len(set(counts)) == 1 else " ".join(map(str, counts))
        # the control is dense: every step of it must issue its all_reduce, or the counting is broken
        bad = [s for s, (n, d) in enumerate(zip(counts, run["densities"])) if n == 0 and (d < 1 or label == CONTROL)]
        print(f"  {label:<42} {text}" + (f"   FAIL: none at step(s) {bad}" if bad else ""))
        silent += [label] if bad else []
    if silent:
        return "FAIL", f"{len(silent)} of {len(runs)} configurations issued no collective at some step"
    return "PASS", f"{len(runs)} configurations, a collective at every compressed step"


def mismatch(run, ref) -> Optional[str]:
    """The first difference of a run from its reference: step, layer, max abs diff; None if bitwise equal."""
    pairs = [(f"step {s} grad", a, b) for s, (sa, sb) in enumerate(zip(run["grads"], ref["grads"]))
             for a, b in zip(sa, sb)]
    pairs += [("final param", a, b) for a, b in zip(run["params"], ref["params"])]
    for j, (where, a, b) in enumerate(pairs):
        if not torch.equal(a, b):
            diff = (a.double() - b.double()).abs()
            layer = j % len(run["params"])
            return (f"{where} of layer {layer} {tuple(a.shape)}: max |diff| {diff.max().item():.3g}, "
                    f"{int((diff != 0).sum())} of {a.numel()} entries differ")
    if len(run["grads"]) != len(ref["grads"]):
        return f"{len(run['grads'])} steps here, {len(ref['grads'])} in the reference"
    return None


def check_bitwise(runs, reference: subprocess.Popen, folder: str, steps: int, timeout: float):
    print("\n-- bitwise against the CPU/gloo run of the same seeds --")
    try:
        out, _ = reference.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        reference.kill()
        return "FAIL", "the CPU reference run did not finish in time"
    if reference.returncode != 0:
        print(out[-3000:])
        return "FAIL", f"the CPU reference run failed (exit {reference.returncode})"
    failed = []
    for i, config in enumerate(configurations()):
        run, path = runs[config.label], os.path.join(folder, f"{i}.pt")
        ref = torch.load(path, weights_only=True) if os.path.exists(path) else None
        ref_error = next((line for line in out.splitlines() if line.startswith(f"reference {i}: ")), "")
        why = (run if isinstance(run, str) else f"the CPU run failed: {ref_error[len(f'reference {i}: '):]}"
               if ref is None else mismatch(run, ref))
        print(f"  {config.label:<42} {'PASS' if why is None else 'FAIL: ' + why}")
        failed += [] if why is None else [config.label]
    if failed:
        return "FAIL", f"{len(failed)} of {len(runs)} differ; first: {failed[0]}"
    return "PASS", f"{len(runs)} configurations x {steps} steps: grads and parameters bitwise equal"


def check_sync(device, size: Size):
    print("\n-- 2 steps under torch.cuda.set_sync_debug_mode('error'), after 3 --")
    failed = {}
    for config in configurations():
        try:
            train(config, device, size, steps=5, sync_steps=(3, 4))
            verdict = "PASS"
        except Exception as exc:
            verdict = failed[config.label] = first_line(exc)
        torch.cuda.synchronize()
        print(f"  {config.label:<42} {verdict}")
    if CONTROL in failed:
        return "FAIL", f"the control ({CONTROL}) synced too: DDP itself, not only the hook ({len(failed)} failed)"
    return ("FAIL", f"{len(failed)} configurations synced; first: {next(iter(failed))}") if failed else (
        "PASS", f"{len(configurations())} configurations, the control included, no host sync")


def check_sanitizer(script_args, timeout: float):
    print("\n-- CUDA sanitizer (TORCH_CUDA_SANITIZER=1, one child) --")
    env = dict(os.environ, TORCH_CUDA_SANITIZER="1")
    try:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--sanitizer-child", *script_args],
                              env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "FAIL", f"the sanitizer child did not finish in {timeout:.0f} s"
    lines = [line[5:] for line in proc.stdout.splitlines() if line.startswith("csan ")]
    print("\n".join(f"  {line}" for line in lines) or proc.stdout[-2000:] + proc.stderr[-2000:])
    if proc.returncode != 0 or not lines:
        return "FAIL", f"the sanitizer child failed (exit {proc.returncode}): {proc.stderr.strip()[-300:]}"
    failed = [line for line in lines if " FAIL: " in line]
    if failed:
        control = any(f.startswith(CONTROL) for f in failed)
        control = " (the control too: DDP or NCCL, not only the hook)" if control else ""
        return "FAIL", f"{len(failed)} of {len(lines)} runs failed{control}; first: {failed[0][:200]}"
    return "PASS", f"{len(lines)} runs, the control included, no race reported"


def sanitizer_child(device, size: Size):
    shapes_size = size._replace(width=4, steps=3)
    for config in (Config(CONTROL), Config("random_block"), Config("randomk", "bucket", "allgather"),
                   Config("topk", "layer", "allgather"), Config("shared_topk")):
        try:
            train(config, device, shapes_size)  # ends with copies to the CPU: every kernel has run
            print(f"csan {config.label} PASS", flush=True)
        except Exception as exc:
            report = " | ".join(line for line in str(exc).splitlines() if line.strip() and "=====" not in line)
            print(f"csan {config.label} FAIL: {report[:400]}", flush=True)


def timing_models(device):
    import torchvision

    def tiny_cnn():
        return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                   torch.nn.Conv2d(8, 16, 3, stride=2, padding=1), torch.nn.BatchNorm2d(16),
                                   torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                                   torch.nn.Linear(16, 10))

    return {"resnet18": (torchvision.models.resnet18, (32, 3, 224, 224), 1000),
            "resnet50": (torchvision.models.resnet50, (32, 3, 224, 224), 1000),
            "tiny-cnn": (tiny_cnn, (4, 3, 16, 16), 10)}


TIMED_HOOKS = {
    CONTROL: lambda: (None, default_hooks.allreduce_hook),
    "PowerSGD rank 4": lambda: (powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                                            start_powerSGD_iter=2), powerSGD_hook.powerSGD_hook),
    **{label: functools.partial(lambda kw: (SparsifyState(density=0.01, density_warmup_steps=0, **kw), sparsify_hook),
                                kw) for label, kw in (
        ("random_block d=0.01", {"method": "random_block"}),
        ("topk d=0.01 allgather", {"method": "topk", "aggregation": "allgather"}),
        ("shared_topk d=0.01", {"method": "shared_topk"}))},
}


def step_ms(name, device, size: Size, make_hook) -> float:
    """Median ms of a steady-state DDP step (forward, backward with the hook, SGD step) on synthetic data."""
    make_model, shape, classes = timing_models(device)[name]
    torch.manual_seed(0)
    model = DDP(make_model().to(device), device_ids=[device.index] if device.type == "cuda" else None)
    model.register_comm_hook(*make_hook())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(shape, device=device), torch.randint(classes, (shape[0],), device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for _ in range(size.warm_steps + size.timed_steps):
        sync()
        start = time.perf_counter()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        sync()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times[size.warm_steps:])


def check_timing(device, size: Size):
    print(f"\n-- ms per step, median of {size.timed_steps} after {size.warm_steps} (no injected delay) --")
    rows, failed = {label: {} for label in TIMED_HOOKS}, []
    for name in size.timing_models:
        for label, make_hook in TIMED_HOOKS.items():
            try:
                rows[label][name] = step_ms(name, device, size, make_hook)
            except Exception as exc:
                failed.append(f"{label} on {name}: {first_line(exc)}")
    print("| hook | " + " | ".join(f"{n} ms | x {CONTROL}" for n in size.timing_models) + " |")
    print("|---|" + "---|---|" * len(size.timing_models))
    for label, times in rows.items():
        cells = [(f"{times[n]:.2f}", f"{times[n] / rows[CONTROL][n]:.2f}") if n in times and n in rows[CONTROL]
                 else ("failed", "") for n in size.timing_models]
        print(f"| {label} | " + " | ".join(f"{ms} | {x}" for ms, x in cells) + " |")
    if failed:
        print("\n".join(f"  FAIL: {f}" for f in failed))
        return "FAIL", f"{len(failed)} rows failed; first: {failed[0]}"
    return "PASS", f"{len(TIMED_HOOKS)} hooks on {', '.join(size.timing_models)}"


# ----- the driver -----

def init_group(device):
    store = os.path.join(tempfile.mkdtemp(prefix="gpu_check_"), "store")
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{store}",
                            rank=0, world_size=1, **kwargs)


def leave(code: int):
    """Flush and leave at once: gloo's teardown aborts a few runs in a hundred after their work is done."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="check the script itself on the CPU (gloo, tiny sizes)")
    p.add_argument("--only", nargs="+", choices=CHECKS, default=list(CHECKS), help="the checks to run (default: all)")
    p.add_argument("--minutes", type=float, default=9.0, help="skip checks not yet started after this (default 9)")
    p.add_argument("--reference", metavar="FOLDER", help=argparse.SUPPRESS)  # the CPU reference child
    p.add_argument("--sanitizer-child", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    started = time.perf_counter()
    size = DRY_SIZE if args.dry_run else CUDA_SIZE
    if args.reference:  # the child: the same configurations on the CPU with gloo, no wrappers, one file each
        init_group(torch.device("cpu"))
        for i, config in enumerate(configurations()):
            try:
                torch.save(train(config, torch.device("cpu"), size), os.path.join(args.reference, f"{i}.pt"))
            except Exception as exc:  # the parent reports it with the configuration
                print(f"reference {i}: {first_line(exc)}", flush=True)
        leave(0)
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device here; `--dry-run` checks the script on the CPU")
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", torch.cuda.current_device())
    init_group(device)
    if args.sanitizer_child:
        sanitizer_child(device, size)
        leave(0)
    name = "CPU (dry run, gloo)" if args.dry_run else f"{torch.cuda.get_device_name(device)} (NCCL)"
    print(f"gpu_check on {name}, torch {torch.__version__}, world size 1, {size.steps} steps, "
          f"{sum(math.prod(s) for s in layer_shapes(size.width))} entries, density {DENSITY}")
    dry = ["--dry-run"] if args.dry_run else []
    results = {}

    def budget_left():
        return args.minutes * 60 - (time.perf_counter() - started)

    def run_check(check, fn, *fn_args):
        if check not in args.only:
            return
        if args.dry_run and check in ("sync", "sanitizer"):
            results[check] = ("SKIPPED", "needs CUDA (dry run)")
        elif budget_left() <= 0:
            results[check] = ("SKIPPED", f"over the --minutes {args.minutes} budget")
        else:
            results[check] = fn(*fn_args)

    if {"collectives", "bitwise"} & set(args.only):
        folder = tempfile.mkdtemp(prefix="gpu_check_ref_")
        reference = subprocess.Popen(  # on the CPU, alongside the GPU runs
            [sys.executable, os.path.abspath(__file__), "--reference", folder, *dry], stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
        cycles = 0 if args.dry_run else sleep_cycles(size.sleep_ms)
        if cycles:
            print(f"each collective waits for a {size.sleep_ms:.0f} ms sleep ({cycles} cycles) on its stream")
        runs = run_configurations(device, size, cycles)
        run_check("collectives", check_collectives, runs)
        run_check("bitwise", lambda: check_bitwise(runs, reference, folder, size.steps, max(60.0, budget_left())))
        if reference.poll() is None:
            reference.kill()
        shutil.rmtree(folder, ignore_errors=True)  # each step's gradients of every configuration
    run_check("sync", check_sync, device, size)
    run_check("timing", check_timing, device, size)
    run_check("sanitizer", lambda: check_sanitizer(dry, max(30.0, min(300.0, budget_left()))))
    print(f"\n== summary ({name}, torch {torch.__version__}, {time.perf_counter() - started:.0f} s) ==")
    for check in CHECKS:
        if check in results:
            print(f"{check:<13}{results[check][0]:<9}{results[check][1]}")
    leave(int(any(status == "FAIL" for status, _ in results.values())))


if __name__ == "__main__":
    main()

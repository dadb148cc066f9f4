"""One host of the cluster benchmark: each method for a few steps at each bandwidth, timed per phase.

``bench_cluster.py`` starts one of these per host, inside the host's network
namespace, with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` and
``GLOO_SOCKET_IFNAME`` set, and the path of a control folder holding
``plan.json``. For every run of the plan and every method it builds a fresh
DDP model (same initialisation everywhere), the recipe's hook and optimizer
(``recipes/comm_setup.py``), takes the method's untimed steps on the unshaped
network, then for each bandwidth asks the controller to reshape the network
and times one window of steps on a fixed synthetic batch (timing only).

Bandwidth changes go through files in the control folder (``cluster_control``).

Per step and rank (``time.perf_counter``, seconds; see ``PHASES``):

* forward: the forward pass and the loss;
* compression: host time inside the comm hook calls (``Exchange.hook_seconds``):
  compensation, selection, residual update and packing for the sparsifiers
  (for ``scope="global"`` all of it in the last bucket's call), the cast for
  fp16, PowerSGD's first half (error feedback, ``P = M Q``), and launching
  the collectives;
* backward: from the start of ``backward()`` to the return of the last hook
  call, minus compression: computing gradients, while the collectives of the
  buckets handed over earlier run on gloo's threads (and compete for the CPU);
* exchange: from the return of the last hook call to the return of
  ``backward()``: the wait for the hooks' futures, with the work their
  callbacks do when a collective completes (decompression; PowerSGD's second
  half: orthogonalisation, ``Q = M^T P``, its second allreduce, ``P Q^T``),
  and DDP copying the averaged buckets into ``.grad``; plus Local AdaAlter's
  averaging collective inside ``optimizer.step()``;
* optimizer: ``optimizer.step()`` without that averaging.

A step's parts add up to its time up to ``zero_grad`` and the loop itself.
"""

from __future__ import annotations

import gc
import json
import math
import os
import sys
import time
import traceback
from collections import defaultdict
from datetime import timedelta
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "recipes"))
sys.path.insert(0, HERE)

from bench_models import build_bench_model, synthetic_batch  # noqa: E402
from cluster_control import RankControl  # noqa: E402
from cluster_plan import HIERARCHICAL_AVERAGER, LR, Method  # noqa: E402
from comm_setup import build_exchange, build_optimizer  # noqa: E402

PHASES = ("forward", "backward", "exchange", "compression", "optimizer")


def _tx_bytes(ifname: str) -> int:
    """Bytes sent by the interface ``ifname`` (in a namespace: its own sysfs, mounted by ``ip netns exec``)."""
    with open(f"/sys/class/net/{ifname}/statistics/tx_bytes") as f:
        return int(f.read())


class PerBucketGroups:
    """One gloo process group per DDP bucket index, made on first use (see ``Method.group_per_bucket``).

    :meth:`wrap` wraps a hook whose state has a ``process_group``: each call
    runs in the group of its bucket. DDP calls the hook for its buckets in
    index order on every rank, so every rank creates the groups in the same
    order (``new_group`` is collective).
    """

    def __init__(self):
        self.groups: List[dist.ProcessGroup] = []

    def group(self, index: int) -> dist.ProcessGroup:
        while len(self.groups) <= index:
            self.groups.append(dist.new_group(backend="gloo"))
        return self.groups[index]

    def wrap(self, hook):
        def hook_in_bucket_group(state, bucket):
            state.process_group = self.group(bucket.index())
            return hook(state, bucket)

        return hook_in_bucket_group


class MethodBench:
    """A fresh DDP model with ``method``'s hook and optimizer, stepping on a fixed batch.

    ``ifname`` is the interface whose sent bytes a window counts;
    ``bucket_groups`` serves the methods that need a group per bucket;
    ``width`` narrows the model (tests).
    """

    def __init__(self, method: Method, model: str, images: torch.Tensor, labels: torch.Tensor, ifname: str,
                 bucket_groups: "PerBucketGroups", width: Optional[int] = None):
        self.ifname = ifname
        torch.manual_seed(0)
        self.ddp = DistributedDataParallel(build_bench_model(model, width=width))
        args = method.recipe_args()
        self.exchange = build_exchange(args)
        if method.optimizer == HIERARCHICAL_AVERAGER:
            self.optimizer = hierarchical_averager(self.ddp.parameters(), method)
        else:
            self.optimizer = build_optimizer(args, self.ddp.parameters(), self.exchange)
        if method.group_per_bucket:
            self.exchange.wrap_hook(bucket_groups.wrap)
        self.exchange.register(self.ddp)
        self.images, self.labels = images, labels
        self.averaging_s = 0.0
        averager = getattr(self.optimizer, "averager", None)
        if averager is not None:  # Local AdaAlter, PyTorch's averagers: time their averaging
            owners = [(averager, "synchronise_" if hasattr(averager, "synchronise_") else "average_parameters")]
            if getattr(averager, "sparse", None) is not None:  # the accumulators' exchange runs beside synchronise_
                owners.append((averager.sparse, "mean_accumulators_"))
            for owner, name in owners:
                def timed(*args, _call=getattr(owner, name), **kwargs):
                    start = time.perf_counter()
                    try:
                        return _call(*args, **kwargs)
                    finally:
                        self.averaging_s += time.perf_counter() - start
                setattr(owner, name, timed)

    def step(self) -> Dict[str, float]:
        t0 = time.perf_counter()
        logits = self.ddp(self.images)  # (batch, classes), or (batch, positions, characters) for the LSTM
        loss = F.cross_entropy(logits.flatten(0, -2), self.labels.flatten())
        t1 = time.perf_counter()
        hook_s, averaging_s = self.exchange.hook_seconds, self.averaging_s
        loss.backward()
        t2 = time.perf_counter()
        self.optimizer.step()
        t3 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        compression = self.exchange.hook_seconds - hook_s
        averaging = self.averaging_s - averaging_s
        last_hook = self.exchange.last_call_end
        if not t1 <= last_hook <= t2:
            raise RuntimeError("the comm hook was not called during backward; the phase split would be wrong")
        return {"forward": t1 - t0, "backward": last_hook - t1 - compression, "compression": compression,
                "exchange": t2 - last_hook + averaging, "optimizer": t3 - t2 - averaging}

    def window(self, steps: int, multiple: int, min_seconds: float, uplinks=None) -> dict:
        """Time a window of steps between barriers; this rank's sums, bytes and per-step times.

        The window has at least ``steps`` steps and lasts about ``min_seconds``
        or more: after its first step the ranks agree (one-float MAX allreduce)
        on ``max(steps, min_seconds / first step)`` steps, rounded up to a
        multiple of ``multiple`` (Local AdaAlter: whole periods). ``uplinks``
        (with nodes): reads the bytes each node has sent to the others.
        """
        before = None if uplinks is None else uplinks()
        dist.barrier()
        tx0, sent0, dense0 = _tx_bytes(self.ifname), self.exchange.bytes_sent, self.exchange.bytes_dense
        sums: Dict[str, float] = defaultdict(float)
        step_times: List[float] = []
        start = time.perf_counter()
        total = 1
        while len(step_times) < total:
            t = time.perf_counter()
            for name, seconds in self.step().items():
                sums[name] += seconds
            step_times.append(time.perf_counter() - t)
            if len(step_times) == 1:
                first = torch.tensor([step_times[0]])
                dist.all_reduce(first, op=dist.ReduceOp.MAX)
                wanted = max(steps, math.ceil(min_seconds / max(first.item(), 1e-6)))
                total = multiple * math.ceil(wanted / multiple)
        seconds = time.perf_counter() - start
        dist.barrier()  # every rank's traffic of the window has been sent
        slow = None if uplinks is None else sum(b - a for a, b in zip(before, uplinks()))
        return {"seconds": seconds, "slow_link": slow, "steps": total, "step_times": step_times, "tx": _tx_bytes(self.ifname) - tx0,
                "sent": self.exchange.bytes_sent - sent0, "dense": self.exchange.bytes_dense - dense0, **sums}


def hierarchical_averager(params, method: Method) -> torch.optim.Optimizer:
    """PyTorch's ``PostLocalSGDOptimizer`` over SGD with a ``HierarchicalModelAverager``: the weights averaged
    over each node's ranks every step and over every rank every ``method.period`` steps (its own allreduces,
    which the hook's byte counter does not see: the wire counters do)."""
    from collections import OrderedDict

    from torch.distributed.algorithms.model_averaging.hierarchical_model_averager import HierarchicalModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer

    periods = OrderedDict([(1, method.ranks_per_node), (method.period, dist.get_world_size())])
    return PostLocalSGDOptimizer(torch.optim.SGD(params, lr=LR), HierarchicalModelAverager(periods, warmup_steps=0))


def combine(per_rank: List[dict]) -> dict:
    """One result from the ranks' windows: means over ranks, per step."""
    n, steps = len(per_rank), per_rank[0]["steps"]

    def mean(key):
        return sum(r[key] for r in per_rank) / n / steps

    out = {"steps": steps, "s_per_step": mean("seconds"),
           "s_per_step_max_rank": max(r["seconds"] for r in per_rank) / steps,
           "step_times_rank0": per_rank[0]["step_times"],
           "payload_bytes_per_step": mean("sent"), "wire_bytes_per_step": mean("tx"),
           "dense_bytes_per_step": mean("dense")}
    if per_rank[0].get("slow_link") is not None:  # the bytes between nodes, per host (every rank read the same)
        out["slow_link_bytes_per_step"] = per_rank[0]["slow_link"] / n / steps
    out.update({f"{name}_s": mean(name) for name in PHASES})
    return out


def run_plan(control_dir: str) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    with open(os.path.join(control_dir, "plan.json")) as f:
        plan = json.load(f)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world,
                            timeout=timedelta(seconds=plan["timeout"]))
    control = RankControl(control_dir, rank, plan["timeout"], dist.barrier)
    bucket_groups = PerBucketGroups()
    for run in plan["runs"]:
        images, labels = synthetic_batch(run["model"], rank, plan["batch"], plan["image_size"])
        for fields in run["methods"]:
            method = Method(**fields)
            control.switch("unshaped")
            bench = MethodBench(method, run["model"], images, labels, os.environ["GLOO_SOCKET_IFNAME"], bucket_groups)
            for _ in range(method.untimed_steps):
                bench.step()
            for bandwidth in run["bandwidths"]:
                control.switch(bandwidth)
                mine = bench.window(plan["steps"], method.step_multiple, plan["min_window_s"],
                                    control.sample if run.get("nodes", 1) > 1 else None)
                gathered: List[dict] = [None] * world  # type: ignore[list-item]
                dist.all_gather_object(gathered, mine)
                if rank == 0:
                    record = {"model": run["model"], "hosts": world, "nodes": run.get("nodes", 1),
                              "bandwidth": bandwidth, "round": run["round"],
                              **method.as_dict(),
                              "params": sum(p.numel() for p in bench.ddp.parameters()), "batch": plan["batch"],
                              "image_size": plan["image_size"], **combine(gathered)}
                    with open(plan["out"], "a") as f:
                        f.write(json.dumps(record) + "\n")
            del bench
            gc.collect()  # free the model, its reducer and hook state before the next one
    dist.barrier()


def run_as_host(body: Callable[[], None]) -> None:
    """Run ``body`` as a cluster host's whole life: its traceback to the log on failure, the process group
    destroyed, and the process ended with ``os._exit`` (0, or 1 after a failure)."""
    code = 0
    try:
        body()
    except BaseException:  # noqa: BLE001 - the controller reads the log
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except BaseException:  # noqa: BLE001
            pass
        # as ddp_hooks.testing: gloo's teardown aborts now and then at interpreter exit
        os._exit(code)


def main(control_dir: str) -> None:
    run_as_host(lambda: run_plan(control_dir))


if __name__ == "__main__":
    main(sys.argv[1])

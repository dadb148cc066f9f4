"""One training run of the time-to-accuracy benchmark: a method on Fashion-MNIST, test accuracy on a schedule.

Each rank trains ``spec["model"]`` (default ``fmnist-cnn``; ``bench_models``) on its contiguous shard of the first
``train`` training images (reshuffled every epoch), 32 images per step, with
the method's hook and optimizer from the recipe's ``comm_setup``
(``tta_plan.training_args``), and every ``eval_every`` steps evaluates on all
10,000 test images, off the clock: the ranks meet at a barrier, each
classifies its share of the test images (for Local AdaAlter with the
average of the ranks' parameters, the model the next averaging would make),
the counts are summed, and the clock restarts after a second barrier.
``train_s`` is therefore the training time of the slowest rank up to each
evaluation, evaluations excluded.

Runs two ways: :func:`train_curve` under ``ddp_hooks.testing.run_distributed``
on loopback (the curves), or as ``python bench/tta_training.py SPEC OUT`` on
each host of the simulated cluster (the wall-clock check), with ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` and ``GLOO_SOCKET_IFNAME``
set; SPEC is a JSON file of :func:`train_curve`'s ``spec``, and rank 0
writes its result as JSON to OUT. With ``spec["stop_at"]`` the run ends at
the first evaluation that reaches that accuracy.
"""

from __future__ import annotations

import copy
import json
import math
import os
import sys
import time
from datetime import timedelta
from typing import List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "recipes"))

from bench_fashion_mnist import epoch_order, rank_shard  # noqa: E402
from bench_models import build_bench_model  # noqa: E402
from cluster_plan import Method  # noqa: E402
from cluster_worker import PerBucketGroups, run_as_host  # noqa: E402
from comm_setup import build_exchange, build_optimizer  # noqa: E402
from fashion_mnist_data import FASHION_MNIST_MEAN, FASHION_MNIST_STD, find_fashion_mnist, read_fashion_mnist  # noqa: E402
from tta_plan import MODEL, learning_rate, training_args  # noqa: E402

__all__ = ["BATCH", "train_curve", "steps_per_epoch", "sharded_accuracy"]

BATCH = 32  # images per rank and step


def steps_per_epoch(train: int, world: int) -> int:
    return (train // world) // BATCH


def _load(data_dir: Optional[str], train: int):
    train_x, train_y, test_x, test_y = read_fashion_mnist(find_fashion_mnist(data_dir))

    def scale(x):
        return ((x.float() / 255.0 - FASHION_MNIST_MEAN[0]) / FASHION_MNIST_STD[0]).unsqueeze(1)

    return scale(train_x[:train]), train_y[:train], scale(test_x), test_y


def sharded_accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, rank: int, world: int) -> float:
    """Test accuracy in percent, every rank classifying its contiguous share of the images (all ranks call it)."""
    share = -(-len(y) // world)
    x, y = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
    was_training = model.training
    model.eval()  # batch norm: the running statistics, not the test batch's
    with torch.no_grad():
        correct = sum(int((model(x[i:i + 2000]).argmax(1) == y[i:i + 2000]).sum()) for i in range(0, len(y), 2000))
    model.train(was_training)
    total = torch.tensor([correct, len(y)], dtype=torch.int64)
    dist.all_reduce(total)
    return 100.0 * int(total[0]) / int(total[1])


def _model_to_evaluate(ddp: DistributedDataParallel, method: Method, world: int) -> torch.nn.Module:
    """The replicas' common model; for Local AdaAlter, whose ranks drift between averagings, their average."""
    if method.optimizer != "local_adaalter":
        return ddp.module
    flat = torch.cat([p.detach().reshape(-1) for p in ddp.module.parameters()])
    dist.all_reduce(flat)
    flat /= world
    averaged = copy.deepcopy(ddp.module)
    torch.nn.utils.vector_to_parameters(flat, averaged.parameters())
    return averaged


def train_curve(rank: int, world: int, spec: dict) -> dict:
    """Train ``spec["method"]`` (``Method`` fields) for ``spec["epochs"]``; rank 0 returns the curve.

    ``spec``: ``method``, ``model`` (a Fashion-MNIST model of ``bench_models``; default ``fmnist-cnn``),
    ``epochs``, ``train`` (training images used),
    ``eval_every`` (steps), ``seed``, ``data_dir`` (None: Debian's folder),
    ``stop_at`` (accuracy in percent, or None). The curve is a list of
    ``{"step", "epoch", "accuracy", "train_s", "payload_bytes", "loss"}``
    at each evaluation (``loss``: the mean training loss since the last).
    """
    torch.set_num_threads(1)
    method = Method(**spec["method"])
    x_train, y_train, x_test, y_test = _load(spec.get("data_dir"), spec["train"])
    xs, ys = rank_shard(x_train, y_train, rank, world)
    shard = len(ys)
    per_epoch = steps_per_epoch(len(y_train), world)
    total = spec["epochs"] * per_epoch
    torch.manual_seed(spec["seed"])
    ddp = DistributedDataParallel(build_bench_model(spec.get("model", MODEL)))
    args = training_args(method)
    exchange = build_exchange(args)
    optimizer = build_optimizer(args, ddp.parameters(), exchange)
    if method.group_per_bucket:
        exchange.wrap_hook(PerBucketGroups().wrap)
    exchange.register(ddp)
    curve: List[dict] = []
    losses: List[float] = []
    train_s, stop = 0.0, torch.zeros(1)
    dist.barrier()
    resumed = time.perf_counter()
    for step in range(total):
        epoch, index = divmod(step, per_epoch)
        if index == 0:
            order = epoch_order(shard, spec["seed"], rank, epoch)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(method, step, total)
        batch = order[index * BATCH:(index + 1) * BATCH]
        loss = F.cross_entropy(ddp(xs[batch]), ys[batch])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if (step + 1) % spec["eval_every"] and step + 1 != total:
            continue
        dist.barrier()  # every rank has finished this step: the clock stops for the slowest
        train_s += time.perf_counter() - resumed
        accuracy = sharded_accuracy(_model_to_evaluate(ddp, method, world), x_test, y_test, rank, world)
        if rank == 0:
            curve.append({"step": step + 1, "epoch": round((step + 1) / per_epoch, 4), "accuracy": accuracy,
                          "train_s": round(train_s, 3), "payload_bytes": exchange.bytes_sent,
                          "loss": sum(losses) / len(losses)})
            stop.fill_(spec.get("stop_at") is not None and accuracy >= spec["stop_at"] or not math.isfinite(
                curve[-1]["loss"]))
        losses = []
        dist.broadcast(stop, 0)
        if stop.item():
            break
        dist.barrier()
        resumed = time.perf_counter()
    return {"label": method.label, "method": method.as_dict(), "steps_per_epoch": per_epoch, "epochs": spec["epochs"],
            "train": spec["train"], "world": world, "seed": spec["seed"], "curve": curve} if rank == 0 else {}


def main(spec_path: str, out_path: str) -> None:
    """A cluster host's entry point (see the module docstring)."""

    def body() -> None:
        with open(spec_path) as f:
            spec = json.load(f)
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world,
                                timeout=timedelta(seconds=spec.get("timeout", 1800)))
        result = train_curve(rank, world, spec)
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(result, f)
        dist.barrier()

    run_as_host(body)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

"""How close a Fashion-MNIST setting trains to the edge of stability: dense runs a millionth apart, side by side.

Run (about 3 minutes)::

    python bench/bench_fmnist_sensitivity.py --out bench/results/fashion-mnist-sensitivity-w4-seed1.jsonl

The settings of ``bench_fashion_mnist.py --world 4 --train 24000`` (the
4-rank tables): the same CNN, data, shards, batches and
``SGD(lr=0.05, momentum=0.9, weight_decay=5e-4)`` with the cosine rate of
an 8-epoch run, for the first ``--steps`` steps of one seed. Each dense run
is PyTorch's ``allreduce_hook`` with the averaged gradient then multiplied
by ``1 + eps``: for ``eps`` of a few 1e-6, a change of the size of the
float rounding that any other exchange (a compressor sending every entry,
another summation order) makes. ``topk`` is ``sparsify_hook`` at its
defaults (density 0.05, AllGather), whose first steps send every entry by
AllReduce: dense in exact arithmetic, rounded its own way.

A run has *collapsed* when its mean training loss over the last 10 steps is
above 2.25 (every output equal gives ln 10 = 2.30): such runs stay at
10 % test accuracy (their gradient near zero: dead ReLUs, by all appearances). If some dense runs collapse and others do not,
the setting decides between them on rounding alone, and one collapsed run of
any method there says nothing about the method.
"""

import argparse
import json
import os
import shlex
import sys

import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_fashion_mnist import cnn, cosine_lr, epoch_order, load, rank_shard, train_step  # noqa: E402
from ddp_hooks import SparsifyState, sparsify_hook  # noqa: E402
from ddp_hooks.testing import run_distributed  # noqa: E402

COLLAPSED_LOSS = 2.25  # ln 10 = 2.303 is the loss of a model whose outputs are all equal
EPOCHS = 8  # the cosine rate is that of the benchmark's 8-epoch runs


def scaled_allreduce(eps: float):
    """PyTorch's allreduce hook, its average multiplied by ``1 + eps`` (exactly the hook at 0)."""
    def hook(state, bucket):
        future = allreduce_hook(state, bucket)
        return future if eps == 0.0 else future.then(lambda f: f.value().mul_(1.0 + eps))

    return hook


def train(rank, world, data, run, args):
    """The first ``args.steps`` steps of one run; rank 0's training losses."""
    xs, ys = rank_shard(data[0], data[1], rank, world)
    ddp = DDP(cnn(args.seed))
    if run["method"] == "dense":
        ddp.register_comm_hook(None, scaled_allreduce(run["eps"]))
    else:
        ddp.register_comm_hook(SparsifyState(method=run["method"], density=0.05, aggregation="allgather",
                                             seed=args.seed), sparsify_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    total = EPOCHS * (len(ys) // args.batch)
    order = epoch_order(len(ys), args.seed, rank, epoch=0)
    losses = []
    for step in range(args.steps):
        idx = order[step * args.batch:(step + 1) * args.batch]
        losses.append(train_step(ddp, opt, xs[idx], ys[idx], cosine_lr(args.lr, step, total)))
    tail = sum(losses[-10:]) / 10
    return {**run, "seed": args.seed, "tail_loss": round(tail, 4), "collapsed": tail > COLLAPSED_LOSS,
            "losses_every_10": [round(v, 3) for v in losses[::10]]}


def body(rank, world, runs, args):
    torch.set_num_threads(1)
    data = load(argparse.Namespace(data_dir=args.data_dir, train=args.train))
    results = [train(rank, world, data, run, args) for run in runs]
    return results if rank == 0 else None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=4, help="ranks (default 4)")
    p.add_argument("--train", type=int, default=24000, help="training images (default 24000)")
    p.add_argument("--seed", type=int, default=1, help="seed of the model and the data order (default 1)")
    p.add_argument("--steps", type=int, default=100, help="steps per run (default 100)")
    p.add_argument("--batch", type=int, default=32, help="images per rank per step (default 32)")
    p.add_argument("--lr", type=float, default=0.05, help="peak learning rate (default 0.05)")
    p.add_argument("--eps", type=float, nargs="+", default=[0.0, 1e-6, -1e-6, 2e-6, -3e-6, 4e-6],
                   help="dense runs: the relative changes of the averaged gradient")
    p.add_argument("--methods", nargs="*", default=["topk"], help="sparsify_hook runs beside dense (default topk)")
    p.add_argument("--data-dir", default=None, help="Fashion-MNIST folder (default: Debian's)")
    p.add_argument("--out", default=None, help="write the command and every run as JSON lines here")
    args = p.parse_args(argv)
    runs = [{"method": "dense", "eps": eps} for eps in args.eps] + [{"method": m, "eps": 0.0} for m in args.methods]
    results = run_distributed(body, args.world, runs, args, timeout=3600)[0]
    command = shlex.join(["python", "bench/bench_fmnist_sensitivity.py", *(argv if argv is not None else sys.argv[1:])])
    print(f"$ {command}\n\n| run | eps | loss, last 10 of {args.steps} steps | collapsed |\n|---|---|---|---|")
    for r in results:
        print(f"| {r['method']} | {r['eps']:g} | {r['tail_loss']:.3f} | {'yes' if r['collapsed'] else 'no'} |")
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps({"command": command, "world": args.world, "train": args.train}) + "\n")
            for r in results:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()

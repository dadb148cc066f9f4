"""Local AdaAlter (H = 4, 8, 16) against synchronous AdaGrad on CPU gloo: rounds, time, loss.

Run::

    python bench/bench_local_adaalter.py --quick          # about a minute on 2 cores
    python bench/bench_local_adaalter.py --epochs 5 --steps 128

Every method trains the same MLP from the same initialisation on the same
synthetic teacher-student classification data (each rank its own shard per
step). "rounds/epoch" counts collectives issued by rank 0 (gradient
allreduces of the hook, plus averagings); "s/epoch" is rank 0's wall time per
epoch (between barriers, warm-up epoch excluded when there is more than one
epoch); "loss" is the mean over ranks of the loss on a fixed held-out set
after the last epoch, which ends on a synchronisation.
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ddp_hooks.adaalter import build_local_adaalter  # noqa: E402
from ddp_hooks.baselines import build_sync_adagrad  # noqa: E402
from ddp_hooks.testing import run_distributed  # noqa: E402

D_IN, HIDDEN, CLASSES = 64, 512, 10


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(D_IN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, HIDDEN),
                               torch.nn.ReLU(), torch.nn.Linear(HIDDEN, CLASSES))


def _teacher():
    g = torch.Generator().manual_seed(42)
    return torch.randn(D_IN, CLASSES, generator=g)


def _batch(teacher, seed, n):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D_IN, generator=g)
    return x, (x @ teacher).argmax(dim=1)


def _build(method, ddp, args):
    if method == "sync AdaGrad":
        counter, opt = build_sync_adagrad(ddp, lr=args.lr, eps=1.0)
        return opt, lambda: counter.allreduce_calls
    period = int(method.split("H=")[1])
    hook_state, opt = build_local_adaalter(ddp, lr=args.lr, eps=1.0, period=period, warmup_steps=args.warmup)
    return opt, lambda: hook_state.allreduce_calls + opt.averager.averagings


def _body(rank, world_size, methods, args):
    teacher = _teacher()
    eval_x, eval_y = _batch(teacher, 10 ** 6, 2048)
    rows = []
    for method in methods:
        ddp = DDP(_model())
        opt, rounds = _build(method, ddp, args)
        times, per_epoch_rounds = [], []
        for epoch in range(args.epochs):
            dist.barrier()
            start, r0 = time.perf_counter(), rounds()
            for step in range(args.steps):
                x, y = _batch(teacher, (epoch * args.steps + step) * world_size + rank, args.batch)
                torch.nn.functional.cross_entropy(ddp(x), y).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            dist.barrier()
            times.append(time.perf_counter() - start)
            per_epoch_rounds.append(rounds() - r0)
        with torch.no_grad():
            loss = torch.nn.functional.cross_entropy(ddp.module(eval_x), eval_y).reshape(1)
        dist.all_reduce(loss)
        timed = times[1:] if len(times) > 1 else times
        rows.append((method, sum(per_epoch_rounds) / len(per_epoch_rounds), sum(timed) / len(timed),
                     loss.item() / world_size))
    return rows


def main(args):
    methods = ["sync AdaGrad"] + [f"Local AdaAlter H={h}" for h in args.periods]
    for h in args.periods:
        if args.steps % h or args.warmup % h:
            raise SystemExit(f"--steps and --warmup must be multiples of every period so epochs end on a "
                             f"synchronisation (got steps={args.steps}, warmup={args.warmup}, H={h})")
    t0 = time.perf_counter()
    rows = run_distributed(_body, args.world_size, methods, args, timeout=600)[0]
    print(f"world_size={args.world_size} epochs={args.epochs} steps/epoch={args.steps} batch/rank={args.batch} "
          f"lr={args.lr} warmup={args.warmup} model={D_IN}-{HIDDEN}-{HIDDEN}-{CLASSES} (gloo, CPU)")
    print(f"{'method':<22}{'rounds/epoch':>14}{'s/epoch':>10}{'loss':>9}")
    for method, rounds, secs, loss in rows:
        print(f"{method:<22}{rounds:>14.1f}{secs:>10.3f}{loss:>9.4f}")
    print(f"total {time.perf_counter() - t0:.1f} s")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="2 epochs of 64 steps (default: 4 of 128)")
    p.add_argument("--epochs", type=int, default=None, help="epochs (default 4, quick 2)")
    p.add_argument("--steps", type=int, default=None, help="steps per epoch (default 128, quick 64)")
    p.add_argument("--batch", type=int, default=32, help="batch per rank (default 32)")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate of every method (default 0.05)")
    p.add_argument("--warmup", type=int, default=16, help="synchronous warm-up steps of Local AdaAlter (default 16)")
    p.add_argument("--periods", type=int, nargs="+", default=[4, 8, 16], help="values of H (default 4 8 16)")
    p.add_argument("--world-size", type=int, default=2, help="processes (default 2)")
    args = p.parse_args(argv)
    if args.epochs is None:
        args.epochs = 2 if args.quick else 4
    if args.steps is None:
        args.steps = 64 if args.quick else 128
    return args


if __name__ == "__main__":
    main(parse_args())

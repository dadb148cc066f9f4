"""Final test accuracy of every sparsifier against dense training, with and without momentum.

Run::

    python bench/bench_convergence.py --quick      # 1 seed, 15 epochs: a few minutes on 2 cores
    python bench/bench_convergence.py              # 3 seeds, 40 epochs

Task: scikit-learn's bundled handwritten digits (``load_digits``: 1797 8x8
images, shipped inside the package, no download), split 1437 train / 360
test once, pixels standardised with the training statistics. Model: an MLP
64-256-256-10 (ReLU), no batch norm. Two gloo ranks on CPU
(``ddp_hooks.testing.run_distributed``), 32 images per rank per step, SGD at
lr 0.1 (cosine decay to 0 by default), weight decay 5e-4, momentum 0.9 or 0.

Every sparsifier runs at layer scope (random selectors with shared positions
and an allreduce; top-k with an allgather) at densities 0.1, 0.05 and 0.01.
With momentum each error-feedback method runs twice:

* ``optimizer``: momentum and weight decay in ``torch.optim.SGD``, error
  feedback on the raw gradient: the pairing shipped before issue 8;
* ``hook``: momentum and weight decay in the hook
  (``SparsifyState(momentum, weight_decay)``), plain ``SGD(lr)``.

``(built)`` marks the placement :func:`ddp_hooks.build_sparsify_sgd` chooses.

``--warmup-epochs E`` gives every sparsifier ``E`` epochs of dense allreduce
first (``SparsifyState.warmup_steps``); the dense baseline is unchanged.
``--methods`` and ``--no-baseline`` run a subset.

Random-k without error feedback is the sanity check that error feedback
matters. A run counts as diverged when its last-epoch training loss is not
finite or above 10; its accuracy is shown with a ``!``. Cells are the mean
over seeds of the final test accuracy in percent, with the spread (max - min)
when there are several seeds; 360 test images make one image 0.28 points.
"""

import argparse
import math
import os
import sys
import time
import warnings

import torch
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ddp_hooks import SparsifyState, sparsify_hook  # noqa: E402
from ddp_hooks.testing import run_distributed  # noqa: E402

DENSITIES = (0.1, 0.05, 0.01)
EF_METHODS = ("random_block", "randomk", "topk")
TRAIN = 1437
DIVERGED_LOSS = 10.0


def load_digits_split():
    """(x_train, y_train, x_test, y_test): the digits data set, split and standardised once."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise SystemExit("bench_convergence needs scikit-learn for its bundled digits data set: "
                         "pip install -e '.[bench]'") from exc
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32)
    y = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    mean, std = x[:TRAIN].mean(0), x[:TRAIN].std(0) + 1e-3
    x = (x - mean) / std
    return x[:TRAIN], y[:TRAIN], x[TRAIN:], y[TRAIN:]


def mlp(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 10))


def configurations(momenta, densities=DENSITIES, placements=("optimizer", "hook"), methods=EF_METHODS,
                   without_feedback=True):
    """(momentum, method, density, error_feedback, placement) of every run; method 'dense' has no density."""
    runs = []
    for m in momenta:
        runs.append((m, "dense", None, False, "-"))
        for density in densities:
            for method in methods:
                for placement in (placements if m > 0 else ("-",)):
                    runs.append((m, method, density, True, placement))
            if without_feedback:
                runs.append((m, "randomk", density, False, "-"))
    return runs


def build(ddp, run, args, seed, steps_per_epoch):
    """Register the run's hook on ``ddp``; return its optimizer."""
    momentum, method, density, error_feedback, placement = run
    if method == "dense":
        ddp.register_comm_hook(None, allreduce_hook)
        return torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=momentum, weight_decay=args.weight_decay)
    options = dict(method=method, density=density, scope="layer", error_feedback=error_feedback, seed=seed,
                   aggregation="allgather" if method == "topk" else "allreduce",
                   warmup_steps=round(args.warmup_epochs * steps_per_epoch))
    if placement == "hook":  # built by hand: the bench shows both placements whatever the builder's rule
        ddp.register_comm_hook(SparsifyState(momentum=momentum, weight_decay=args.weight_decay, **options),
                               sparsify_hook)
        return torch.optim.SGD(ddp.parameters(), lr=args.lr)
    ddp.register_comm_hook(SparsifyState(**options), sparsify_hook)
    return torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=momentum, weight_decay=args.weight_decay)


def train_one(rank, world, data, run, args, seed):
    """Final (test accuracy in %, last-epoch mean training loss) of one run on this rank."""
    x_train, y_train, x_test, y_test = data
    ddp = DDP(mlp(seed))
    steps_per_epoch = TRAIN // (world * args.batch)
    opt = build(ddp, run, args, seed, steps_per_epoch)
    total = args.epochs * steps_per_epoch
    losses = []
    for epoch in range(args.epochs):
        order = torch.randperm(TRAIN, generator=torch.Generator().manual_seed(1000 * seed + epoch))
        losses = []
        for s in range(steps_per_epoch):
            step = epoch * steps_per_epoch + s
            if args.schedule == "cosine":
                for group in opt.param_groups:
                    group["lr"] = args.lr * 0.5 * (1.0 + math.cos(math.pi * step / total))
            first = (s * world + rank) * args.batch
            idx = order[first:first + args.batch]
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(ddp(x_train[idx]), y_train[idx])
            loss.backward()
            opt.step()
            losses.append(loss.item())
    with torch.no_grad():
        accuracy = (ddp.module(x_test).argmax(1) == y_test).float().mean().item() * 100
    return accuracy, sum(losses) / len(losses)


def body(rank, world, runs, args, seeds):
    torch.set_num_threads(1)
    data = load_digits_split()
    results = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the 'optimizer' placement of random selectors warns on purpose
        for seed in seeds:
            for run in runs:
                results.append((seed, run) + train_one(rank, world, data, run, args, seed))
    return results


def _cell(values):
    accs = [a for a, _ in values]
    diverged = sum(not (loss <= DIVERGED_LOSS) for _, loss in values)
    text = f"{sum(accs) / len(accs):.1f}"
    if len(accs) > 1:
        text += f" ±{(max(accs) - min(accs)) / 2:.1f}"
    if diverged:
        text += f" !{diverged}/{len(accs)}"
    return text


def table(results, momenta, densities):
    """Markdown tables, one per momentum, from ``(seed, run, accuracy, loss)`` rows."""
    by_run = {}
    for seed, run, accuracy, loss in results:
        by_run.setdefault(run, []).append((accuracy, loss))
    lines = []
    for m in momenta:
        dense = _cell(by_run[(m, "dense", None, False, "-")])
        lines += ["", f"momentum {m:g}: dense {dense}", "",
                  "| method | error feedback | momentum in | " + " | ".join(f"d={d:g}" for d in densities) + " |",
                  "|---|---|---|" + "---|" * len(densities)]
        keys = sorted({(run[1], run[3], run[4]) for run in by_run if run[0] == m and run[1] != "dense"},
                      key=lambda k: (not k[1], EF_METHODS.index(k[0]), k[2]))
        for method, ef, placement in keys:
            where = placement if m > 0 else "-"
            if m > 0 and ef and placement == "optimizer":  # build_sparsify_sgd keeps SGD's momentum
                where += " (built)"
            cells = [_cell(by_run[(m, method, d, ef, placement)]) for d in densities]
            lines.append(f"| {method} | {'yes' if ef else 'no'} | {where} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(args):
    seeds = list(range(args.seed_start, args.seed_start + args.seeds))
    runs = configurations(args.momenta, args.densities, args.placements, args.methods, not args.no_baseline)
    start = time.perf_counter()
    results = run_distributed(body, 2, runs, args, seeds, timeout=3600)[0]
    print(f"digits MLP 64-256-256-10, 2 gloo ranks, batch {args.batch}/rank, {args.epochs} epochs, lr {args.lr} "
          f"({args.schedule}), weight decay {args.weight_decay}, layer scope, dense warm-up {args.warmup_epochs:g} "
          f"epochs, seeds {seeds}; final test accuracy %, "
          f"mean ±half-range over seeds, !n/N = n of N runs diverged")
    print(table(results, args.momenta, args.densities))
    if args.per_seed:
        print("\nper seed (seed, momentum, method, density, error feedback, momentum in, accuracy, last-epoch loss):")
        for seed, run, accuracy, loss in results:
            print(seed, *run, f"{accuracy:.2f}", f"{loss:.4g}")
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="1 seed, 15 epochs (default: 3 seeds, 40 epochs)")
    p.add_argument("--seeds", type=int, default=None, help="number of seeds (default 3, quick 1)")
    p.add_argument("--epochs", type=int, default=None, help="epochs (default 40, quick 15)")
    p.add_argument("--batch", type=int, default=32, help="images per rank per step (default 32)")
    p.add_argument("--lr", type=float, default=0.1, help="peak learning rate (default 0.1)")
    p.add_argument("--schedule", choices=("cosine", "constant"), default="cosine", help="lr schedule (default cosine)")
    p.add_argument("--weight-decay", type=float, default=5e-4, help="weight decay (default 5e-4)")
    p.add_argument("--momenta", type=float, nargs="+", default=[0.9, 0.0], help="momentum values (default 0.9 0)")
    p.add_argument("--seed-start", type=int, default=0, help="first seed (default 0)")
    p.add_argument("--densities", type=float, nargs="+", default=list(DENSITIES), help="densities (default 0.1 0.05 0.01)")
    p.add_argument("--placements", nargs="+", choices=("optimizer", "hook"), default=["optimizer", "hook"],
                   help="where momentum runs, for error-feedback methods with momentum (default: both)")
    p.add_argument("--methods", nargs="+", choices=EF_METHODS, default=list(EF_METHODS),
                   help="error-feedback methods (default: all)")
    p.add_argument("--no-baseline", action="store_true", help="leave out random-k without error feedback")
    p.add_argument("--warmup-epochs", type=float, default=0.0,
                   help="epochs of dense allreduce before sparsifying (SparsifyState.warmup_steps; default 0)")
    p.add_argument("--per-seed", action="store_true", help="also print every run")
    args = p.parse_args(argv)
    if args.seeds is None:
        args.seeds = 1 if args.quick else 3
    if args.epochs is None:
        args.epochs = 15 if args.quick else 40
    return args


if __name__ == "__main__":
    main(parse_args())

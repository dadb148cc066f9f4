"""Test accuracy of every sparsifier against dense training on real images (Fashion-MNIST), in unchanged user code.

Run (each part is one command; ``--part`` picks the table)::

    python bench/bench_fashion_mnist.py --part headline --schedule cosine     # every method x density, 3 seeds
    python bench/bench_fashion_mnist.py --part headline --schedule constant
    python bench/bench_fashion_mnist.py --part ablations                      # 1 seed
    python bench/bench_fashion_mnist.py --part block-sizes
    python bench/bench_fashion_mnist.py --part workers                        # random-block, 2 and 4 ranks
    python bench/bench_fashion_mnist.py --part shared-topk --seeds 3          # 2 and 4 ranks (issue 18)
    python bench/bench_fashion_mnist.py --part nodes --world 4 --seeds 3 --train 24000  # nodes of 2 against flat
    python bench/bench_fashion_mnist.py --part shared-topk-ablations --seeds 3  # low-pass filter, momentum
    python bench/bench_fashion_mnist.py --part adamw --optimizer adamw --schedule cosine  # AdamW, 3 seeds
    python bench/bench_fashion_mnist.py --quick                               # a smoke run: 1 seed, 1 epoch

Data: Fashion-MNIST from Debian's ``dataset-fashion-mnist`` package (read by
``recipes/fashion_mnist_data.py``; ``--data-dir`` for another copy): the
first ``--train`` training images (default 12,000, the same ones for every
run), cut into one contiguous shard per rank, and all 10,000 test images.
Model: a small CNN (convolutions 1-16 and 16-32 of 5x5 and 32-32 of 3x3,
each with ReLU and 2x2 max-pooling, then linear 288-10; 25,386 parameters in
8 tensors) with no batch norm, so that nothing but the exchanged gradient
couples the ranks. ``--world`` gloo ranks on the CPU, 32 images per rank per
step, each rank shuffling its own shard every epoch.

User code is what a DDP user already has: ``torch.optim.SGD(lr=0.05,
momentum=0.9, weight_decay=5e-4)``, a cosine or constant learning rate, and
one added line, ``ddp.register_comm_hook(SparsifyState(method=..., density=...),
sparsify_hook)`` with default options; with ``--optimizer adamw`` the user's
optimizer is ``torch.optim.AdamW(lr=1e-3, weight_decay=0.01)``. ``build`` rows use
:func:`ddp_hooks.build_sparsify_sgd` instead; ``dense`` is PyTorch's
``allreduce_hook`` in the same code. Every method at layer scope, top-k with
AllGather, the random selectors with AllReduce (the defaults).

Cells: final test accuracy in percent, the mean over seeds with half the
range; ``!n`` marks n runs whose last-epoch training loss was not finite
(diverged). One test image is 0.01 points. The results (``--out``) hold
every run, one JSON line each, and start with the command that made them.
"""

import argparse
import json
import math
import os
import shlex
import sys
import time

import torch
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "recipes"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ddp_hooks import SparsifyState, build_sparsify_sgd, sparsify_hook  # noqa: E402
from ddp_hooks.testing import run_distributed  # noqa: E402
from cifar_models import small_cnn as cnn  # noqa: E402,F401 (the benchmarks' model, imported from here)
from fashion_mnist_data import find_fashion_mnist, read_fashion_mnist  # noqa: E402
from result_files import every_run, read_results  # noqa: E402

METHODS = ("topk", "random_block", "randomk")
DENSITIES = (0.1, 0.05, 0.01)


def run_config(name: str, hook=None, build: bool = False, ef: bool = True, pairing: str = "optimizer", **options):
    """One row of a table: a label and how to set up its exchange.

    ``build``: through :func:`ddp_hooks.build_sparsify_sgd`. ``pairing="hook"``:
    momentum and weight decay in the hook (``SparsifyState(momentum,
    weight_decay)``) with plain ``SGD(lr)``, the pairing shipped before issue 16.
    """
    return {"name": name, "hook": hook, "build": build, "error_feedback": ef, "pairing": pairing, "options": options}


def default_aggregation(method: str) -> dict:
    """The aggregation a user gets by default with ``method``: top-k gathers, the others reduce."""
    return {"aggregation": "allgather"} if method == "topk" else {}


def headline(densities=DENSITIES, methods=METHODS):
    runs = [run_config("dense", hook="dense")]
    for density in densities:
        for method in methods:
            runs.append(run_config(f"{method} d={density:g}", hook="sparsify", method=method, density=density,
                                   **default_aggregation(method)))
        runs.append(run_config(f"randomk no-EF d={density:g}", hook="sparsify", ef=False, method="randomk",
                               density=density))
    return runs


def user_optimizer(params, args):
    """The user's optimizer: ``SGD(lr, momentum, weight_decay)`` or ``AdamW(lr, weight_decay)`` (``--optimizer``)."""
    if args.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    return torch.optim.SGD(params, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)


def setup_exchange(ddp, run, args, seed):
    """Register the run's hook; return its optimizer (the user's, unchanged, unless the run builds the pair)."""
    sgd = dict(lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    if run["hook"] == "dense":
        ddp.register_comm_hook(None, allreduce_hook)
        return user_optimizer(ddp.parameters(), args), None
    options = dict(run["options"], error_feedback=run["error_feedback"], seed=seed)
    if args.optimizer != "sgd" and (run["build"] or run.get("pairing") == "hook"):
        raise ValueError(f"run {run['name']!r} builds its own SGD (build_sparsify_sgd, or momentum in the hook), "
                         f"so --optimizer {args.optimizer} would not be what it trains with: run it with SGD")
    if run["build"]:
        state, opt = build_sparsify_sgd(ddp, **sgd, **options)
        return opt, state
    if run.get("pairing") == "hook":
        state = SparsifyState(momentum=args.momentum, weight_decay=args.weight_decay, **options)
        ddp.register_comm_hook(state, sparsify_hook)
        return torch.optim.SGD(ddp.parameters(), lr=args.lr), state
    state = SparsifyState(**options)
    ddp.register_comm_hook(state, sparsify_hook)
    return user_optimizer(ddp.parameters(), args), state


def train_one(rank, world, data, run, args, seed):
    x_train, y_train, x_test, y_test = data
    xs, ys = rank_shard(x_train, y_train, rank, world)
    shard = len(ys)
    ddp = DDP(cnn(seed))
    opt, state = setup_exchange(ddp, run, args, seed)
    steps_per_epoch = shard // args.batch
    total = args.epochs * steps_per_epoch
    curve, losses = [], []
    start = time.perf_counter()
    for epoch in range(args.epochs):
        order = epoch_order(shard, seed, rank, epoch)
        losses = []
        for s in range(steps_per_epoch):
            lr = cosine_lr(args.lr, epoch * steps_per_epoch + s, total) if args.schedule == "cosine" else None
            idx = order[s * args.batch:(s + 1) * args.batch]
            losses.append(train_step(ddp, opt, xs[idx], ys[idx], lr))
        curve.append(round(evaluate(ddp.module, x_test, y_test), 2))
    return {"seed": seed, "name": run["name"], "accuracy": curve[-1], "curve": curve,
            "last_epoch_loss": sum(losses) / len(losses), "seconds": round(time.perf_counter() - start, 1),
            "bytes_ratio": None if state is None else state.stats()["compression_ratio"]}


def rank_shard(x, y, rank: int, world: int):
    """Rank ``rank``'s contiguous shard of ``(x, y)``, ``len(y) // world`` examples (the rest unused)."""
    shard = len(y) // world
    return x[rank * shard:(rank + 1) * shard], y[rank * shard:(rank + 1) * shard]


def epoch_order(shard: int, seed: int, rank: int, epoch: int) -> torch.Tensor:
    """The order in which rank ``rank`` reads its shard in ``epoch`` of the run of ``seed``."""
    return torch.randperm(shard, generator=torch.Generator().manual_seed(10_000 * seed + 100 * rank + epoch))


def cosine_lr(peak: float, step: int, total: int) -> float:
    """The cosine rate at ``step`` of ``total``: ``peak (1 + cos(pi step / total)) / 2``."""
    return peak * 0.5 * (1.0 + math.cos(math.pi * step / total))


def train_step(ddp, opt, x, y, lr=None) -> float:
    """One SGD step on the batch ``(x, y)`` at learning rate ``lr`` (None: the optimizer's); the loss."""
    if lr is not None:
        for group in opt.param_groups:
            group["lr"] = lr
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(ddp(x), y)
    loss.backward()
    opt.step()
    return loss.item()


def evaluate(model, x, y) -> float:
    with torch.no_grad():
        correct = sum(int((model(x[i:i + 2000]).argmax(1) == y[i:i + 2000]).sum()) for i in range(0, len(y), 2000))
    return 100.0 * correct / len(y)


def load(args):
    train_x, train_y, test_x, test_y = read_fashion_mnist(find_fashion_mnist(args.data_dir))
    scale = lambda x: ((x.float() / 255.0 - 0.2860) / 0.3530).unsqueeze(1)  # noqa: E731 (the data set's mean, std)
    return scale(train_x[:args.train]), train_y[:args.train], scale(test_x), test_y


def body(rank, world, runs, args, seeds):
    torch.set_num_threads(1)
    data = load(args)
    return every_run(rank, seeds, runs, lambda run, seed: train_one(rank, world, data, run, args, seed))


def cell(results, key="accuracy", digits=2):
    """A table cell: the mean of ``key`` over the runs (seeds), ± half their range, ``!n`` if n diverged."""
    values = [r[key] for r in results]
    text = f"{sum(values) / len(values):.{digits}f}"
    if len(values) > 1:
        text += f" ±{(max(values) - min(values)) / 2:.{digits}f}"
    diverged = sum(not math.isfinite(r["last_epoch_loss"]) for r in results)
    return text + (f" !{diverged}" if diverged else "")


def ablations(densities=(0.05, 0.01)):
    """Each a change of one default of random-block (the headline's row), and top-k with momentum in sends."""
    runs = []
    for d in densities:
        block = dict(hook="sparsify", method="random_block", density=d)
        runs += [
            run_config(f"random_block own-momentum d={d:g}", pairing="hook", **block),
            run_config(f"random_block steps d={d:g}", optimizer_momentum="steps", **block),
            run_config(f"random_block dw=0 d={d:g}", density_warmup_steps=0, **block),
            run_config(f"random_block global d={d:g}", scope="global", **block),
            run_config(f"randomk global d={d:g}", hook="sparsify", method="randomk", density=d, scope="global"),
            run_config(f"random_block allgather d={d:g}", aggregation="allgather", **block),
            run_config(f"topk sends d={d:g}", hook="sparsify", method="topk", density=d, aggregation="allgather",
                       optimizer_momentum="sends", density_warmup_steps=0),
            run_config(f"topk dw=1000 d={d:g}", hook="sparsify", method="topk", density=d, aggregation="allgather",
                       density_warmup_steps=1000),
            run_config(f"topk sends dw=1000 d={d:g}", hook="sparsify", method="topk", density=d,
                       aggregation="allgather", optimizer_momentum="sends", density_warmup_steps=1000),
        ]
    return runs


def block_sizes(densities=(0.05, 0.01), sizes=(1, 4, 16, 64, 256, 1 << 30)):
    runs = [run_config("dense", hook="dense")]
    for d in densities:
        for b in sizes:
            label = "one block" if b == 1 << 30 else b
            runs.append(run_config(f"random_block b={label} d={d:g}", hook="sparsify", method="random_block",
                                   density=d, block_size=b))
    return runs


def workers(densities=(0.05, 0.01)):
    """Shared blocks (AllReduce) against each rank's own (AllGather); run at --world 2 and 4."""
    runs = [run_config("dense", hook="dense")]
    for d in densities:
        for aggregation in ("allreduce", "allgather"):
            runs.append(run_config(f"random_block {aggregation} d={d:g}", hook="sparsify", method="random_block",
                                   density=d, aggregation=aggregation))
    return runs


def nodes(densities=(0.01,), methods=("random_block", "shared_topk")):
    """Dense inside nodes of 2 ranks and sparse between them, against the flat exchange; run at --world 4."""
    runs = [run_config("dense", hook="dense")]
    for d in densities:
        for method in methods:
            runs.append(run_config(f"{method} flat d={d:g}", hook="sparsify", method=method, density=d))
            runs.append(run_config(f"{method} nodes=2 d={d:g}", hook="sparsify", method=method, density=d, nodes=2))
    return runs


def matrix(results):
    """A markdown table: one row per configuration, one column per density; cells are mean ±half-range
    (gap to dense in points)."""
    dense = [r["accuracy"] for r in results if r["name"] == "dense"]
    dense_mean = sum(dense) / len(dense) if dense else None
    rows, densities = {}, []
    for r in results:
        if r["name"] == "dense":
            continue
        label, _, density = r["name"].rpartition(" d=")
        rows.setdefault(label, {}).setdefault(density, []).append(r)
        if density not in densities:
            densities.append(density)
    densities.sort(key=float, reverse=True)
    lines = ["| run | " + " | ".join(f"d={d}" for d in densities) + " |", "|---|" + "---|" * len(densities)]
    if dense:
        lines.append(f"| dense (allreduce hook) | {cell([r for r in results if r['name'] == 'dense'])} |"
                     + " |" * (len(densities) - 1))
    for label, by_density in rows.items():
        cells = []
        for d in densities:
            runs = by_density.get(d)
            if not runs:
                cells.append("")
                continue
            mean = sum(r["accuracy"] for r in runs) / len(runs)
            gap = "" if dense_mean is None else f" ({mean - dense_mean:+.2f})"
            cells.append(cell(runs) + gap)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(paths, merge=False):
    """Print each results file's command, header and table (bench/README.md's tables come from here).

    ``merge``: one table of all files, a later file's run replacing an
    earlier one of the same name and seed (a rerun of some rows).
    """
    merged = {}
    for path in paths:
        first, rest = read_results(path)
        if not merge:
            print(f"$ {first['command']}\n{first['header']}\n\n{matrix(rest)}\n")
            continue
        print(f"$ {first['command']}\n{first['header']}")
        merged.update({(r["name"], r["seed"]): r for r in rest})
    if merge:
        print(f"\n{matrix(list(merged.values()))}\n")


def shared_topk(densities=(0.05, 0.01)):
    """Shared top-k (one leader's positions, AllReduce) against top-k (AllGather), random-block and dense."""
    runs = [run_config("dense", hook="dense")]
    for d in densities:
        for method in ("topk", "random_block", "shared_topk"):
            runs.append(run_config(f"{method} d={d:g}", hook="sparsify", method=method, density=d,
                                   **default_aggregation(method)))
    return runs


def shared_topk_ablations(density=0.01):
    """Shared top-k: ScaleCom's low-pass filter on the error-feedback memory (error_feedback_beta) against
    plain error feedback (beta 1), and the optimizer's momentum per step instead of counted in sends."""
    runs = [run_config("dense", hook="dense")]
    for beta in (1.0, 0.9, 0.5):
        runs.append(run_config(f"shared_topk beta={beta:g} d={density:g}", hook="sparsify", method="shared_topk",
                               density=density, error_feedback_beta=beta))
    runs.append(run_config(f"shared_topk momentum-steps d={density:g}", hook="sparsify", method="shared_topk",
                           density=density, optimizer_momentum="steps"))
    return runs


def adamw(densities=(0.05, 0.01)):
    """Every error-feedback selector under the user's AdamW (run with ``--optimizer adamw``), default options,
    and each without the density warm-up at the lower density."""
    runs = [run_config("dense", hook="dense")]
    methods = ("topk", "random_block", "randomk", "shared_topk")
    for d in densities:
        for method in methods:
            runs.append(run_config(f"{method} d={d:g}", hook="sparsify", method=method, density=d,
                                   **default_aggregation(method)))
    for method in methods:
        runs.append(run_config(f"{method} dw=0 d={densities[-1]:g}", hook="sparsify", method=method,
                               density=densities[-1], density_warmup_steps=0,
                               **default_aggregation(method)))
    return runs


PARTS = {"headline": headline, "ablations": ablations, "block-sizes": block_sizes, "workers": workers,
         "shared-topk": shared_topk, "shared-topk-ablations": shared_topk_ablations, "nodes": nodes,
         "adamw": adamw}


def main(argv=None):
    args = parse_args(argv)
    if args.report:
        return report(args.report, args.merge)
    runs = PARTS[args.part]()
    if args.only:
        runs = [r for r in runs if any(r["name"] == word for word in args.only)]
    seeds = list(range(args.seed_start, args.seed_start + args.seeds))
    command = shlex.join(["python", "bench/bench_fashion_mnist.py", *(argv if argv is not None else sys.argv[1:])])
    start = time.perf_counter()
    results = run_distributed(body, args.world, runs, args, seeds, timeout=3 * 3600)[0]
    header = (f"Fashion-MNIST, {args.train} training images in {args.world} shards, 10,000 test images; CNN; "
              f"batch {args.batch}/rank, {args.epochs} epochs, {optimizer_text(args)}; seeds {seeds}; "
              f"{time.perf_counter() - start:.0f} s")
    print(f"\n$ {command}\n{header}\n\n{matrix(results)}")
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps({"command": command, "header": header}) + "\n")
            for r in results:
                f.write(json.dumps(r) + "\n")


def optimizer_text(args) -> str:
    if args.optimizer == "adamw":
        return f"AdamW lr {args.lr} ({args.schedule}), weight decay {args.weight_decay}"
    return f"SGD lr {args.lr} ({args.schedule}), momentum {args.momentum}, weight decay {args.weight_decay}"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", choices=sorted(PARTS), default="headline", help="which table (default headline)")
    p.add_argument("--quick", action="store_true", help="1 seed, 1 epoch, 4,000 images: a smoke run")
    p.add_argument("--only", nargs="+", default=None, help="keep only the runs of these names")
    p.add_argument("--seeds", type=int, default=None, help="number of seeds (default 3 for headline, else 1)")
    p.add_argument("--seed-start", type=int, default=0, help="first seed (default 0)")
    p.add_argument("--epochs", type=int, default=None, help="epochs (default 8)")
    p.add_argument("--train", type=int, default=None, help="training images used (default 12000)")
    p.add_argument("--world", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--batch", type=int, default=32, help="images per rank per step (default 32)")
    p.add_argument("--optimizer", choices=("sgd", "adamw"), default=None,
                   help="the user's optimizer (default: adamw for --part adamw, else sgd; adamw: lr 1e-3, weight "
                        "decay 0.01 unless given)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default 0.05 for SGD, 1e-3 for AdamW)")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default 0.9)")
    p.add_argument("--weight-decay", type=float, default=None,
                   help="weight decay (default 5e-4 for SGD, 0.01 for AdamW)")
    p.add_argument("--schedule", choices=("cosine", "constant"), default="cosine", help="lr schedule (default cosine)")
    p.add_argument("--data-dir", default=None, help="Fashion-MNIST folder (default: Debian's)")
    p.add_argument("--out", default=None, help="write every run as JSON lines here")
    p.add_argument("--report", nargs="+", default=None, help="print the tables of these results files and stop")
    p.add_argument("--merge", action="store_true", help="with --report: one table, later files replacing rows")
    args = p.parse_args(argv)
    if args.seeds is None:
        args.seeds = 1 if args.quick or args.part not in ("headline", "adamw") else 3
    if args.optimizer is None:
        args.optimizer = "adamw" if args.part == "adamw" else "sgd"
    if args.part == "adamw" and args.optimizer != "adamw":
        p.error(f"--part adamw with --optimizer {args.optimizer}: that part measures the selectors under AdamW")
    adam = args.optimizer == "adamw"
    if args.lr is None:
        args.lr = 1e-3 if adam else 0.05
    if args.weight_decay is None:
        args.weight_decay = 0.01 if adam else 5e-4
    if args.epochs is None:
        args.epochs = 1 if args.quick else 8
    if args.train is None:
        args.train = 4000 if args.quick else 12000
    return args


if __name__ == "__main__":
    main()

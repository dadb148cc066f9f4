"""Local AdaAlter against synchronous AdaGrad and PyTorch's post-local SGD on real data, at equal epochs.

Run (each part is one command; ``--task`` picks the data, ``--world`` the ranks)::

    python bench/bench_adaalter_convergence.py --task fashion-mnist --world 2 --out bench/results/adaalter-fmnist-w2.jsonl
    python bench/bench_adaalter_convergence.py --task fortunes --world 2 --out bench/results/adaalter-fortunes-w2.jsonl
    python bench/bench_adaalter_convergence.py --task fashion-mnist --world 4 ...
    python bench/bench_adaalter_convergence.py --report bench/results/adaalter-*.jsonl   # bench/README.md's tables
    python bench/bench_adaalter_convergence.py --quick                                  # a smoke run

Tasks (each rank trains on its own contiguous shard; epochs and data are the
same at every world size, so 4 ranks take half the steps of 2):

* ``fashion-mnist``: the first 12,288 training images of Fashion-MNIST
  (Debian's ``dataset-fashion-mnist``), the CNN of
  ``bench/bench_fashion_mnist.py`` (25,386 parameters), 32 images per rank
  per step; the metric is the accuracy on all 10,000 test images.
* ``fortunes``: a character-level LSTM language model (embedding 64, one LSTM
  layer of 128, 120,944 parameters) on Debian's ``fortunes`` files
  (``bench/fortunes_text.py``): the first 786,432 characters of the training
  text, 32 windows of 64 characters per rank per step; the metric is the
  perplexity per character on the first 65,536 characters of the validation
  text (every tenth fortune).

Both tasks: 4 epochs of 384 / world_size steps per rank; warm-up (synchronous
steps before local ones) 32 steps for every local method. After each epoch
the ranks' average is evaluated (off the clock, not counted): for Local
AdaAlter with H <= 32 at 2 and 4 ranks every epoch ends on an averaging, so
that is the model itself (checked: the ranks' parameters are compared); for
larger H, and for PyTorch's
``PeriodicModelAverager`` (which averages after steps ``warmup + 1 + k H``),
it is what an averaging at the end of the epoch would give. Methods: ``sync AdaGrad``
(:func:`ddp_hooks.build_sync_adagrad`: PyTorch's allreduce hook and
``torch.optim.Adagrad``), ``LAA H=h <rule>`` (:func:`ddp_hooks.build_local_adaalter`
with ``lazy_correction=<rule>``), ``LAA H=h <rule> outer`` (the same with the
DiLoCo outer optimizer, ``outer_lr=0.7, outer_momentum=0.9``, Nesterov) and
``local SGD H=h`` (:func:`ddp_hooks.build_local_sgd`: PyTorch's
``post_localSGD_hook`` and ``PeriodicModelAverager``, SGD with momentum 0.9).
AdaGrad and Local AdaAlter share one learning rate and ``eps`` per task.

Sparse synchronisation rows (``LAA H=h rate w0 <selector> d=<density>
[acc=<a>] [outer]``, ``local SGD H=h w0 <selector> d=<density> [outer]``):
at each synchronisation every rank sends its pseudo-gradient through
:class:`ddp_hooks.adaalter.SparseAverage` (error feedback) instead of its
parameters; ``w0``: no synchronous warm-up (local steps from the first);
``fp16`` after the density sends the values in float16; ``acc=sparse`` (the
default of a sparse row) sends the accumulators through the compressor too,
``acc=sparseN`` at every N-th synchronisation, ``acc=dense`` averages them
densely at every synchronisation, ``acc=denseN`` densely every N-th; ``outer``: OuterSGD
(0.7, 0.9, Nesterov). The sparse local SGD rows use
:class:`ddp_hooks.AdaAlterAverager` with PyTorch's ``post_localSGD_hook``
(DiLoCo with SGD inside).

"syncs/epoch" counts the ``all_reduce`` calls of rank 0 per epoch, from every
source (gradient buckets, averagings), measured by wrapping
``torch.distributed.all_reduce``; "bytes/step" the bytes rank 0 hands to
every collective (``all_reduce``, the ``all_gather`` family, and the
``broadcast`` of shared top-k's positions on the rank that sends them) per
step, and "x fewer" synchronous AdaGrad's bytes per step over the row's. Cells of the tables: the mean over seeds
and half the range; the results (``--out``) hold every run, one JSON line
each, with the per-epoch curve, and start with the command that made them.
"""

import argparse
import copy
import json
import math
import os
import shlex
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "recipes"))

from adaalter_tables import family_and_period, report, table  # noqa: E402
from bench_fashion_mnist import cnn, epoch_order, evaluate, rank_shard  # noqa: E402
from bench_models import CharLSTM  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as plsgd  # noqa: E402
from ddp_hooks import AdaAlterAverager, OuterSGD, build_local_adaalter, build_local_sgd, build_sync_adagrad  # noqa: E402
from ddp_hooks.adaalter import SparseAverage  # noqa: E402
from ddp_hooks.testing import run_distributed  # noqa: E402
from fashion_mnist_data import find_fashion_mnist, read_fashion_mnist  # noqa: E402
from fortunes_text import load_fortunes  # noqa: E402

STEPS_TOTAL = 384  # per epoch, summed over ranks: 12,288 examples of 32
WARMUP = 32
SEQ, CHARS_TRAIN, CHARS_VALID = 64, 786_432, 65_536
#: per task: AdaGrad's and Local AdaAlter's lr and eps, local SGD's lr (chosen by the sweep in bench/README.md)
RULES = ("paper", "constant", "rate")
TASKS = {"fashion-mnist": {"lr": 0.1, "eps": 1.0, "sgd_lr": 0.05},
         "fortunes": {"lr": 0.3, "eps": 0.1, "sgd_lr": 0.5}}


def char_lstm(vocab: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return CharLSTM(vocab)


SELECTORS = ("random_block", "shared_topk", "topk", "randomk")


def run_config(name, kind, period=None, rule=None, outer=False, warmup=WARMUP, selector=None, density=None,
               accumulators="dense", value_dtype=None):
    return {"name": name, "kind": kind, "period": period, "rule": rule, "outer": outer, "warmup": warmup,
            "selector": selector, "density": density, "accumulators": accumulators, "value_dtype": value_dtype}


def _options_of(words):
    """The options after a row's rule: ``[w0] [<selector> d=<density>] [acc=<a>] [outer]``, or None."""
    options = {"outer": words[-1:] == ["outer"]}
    words = words[:len(words) - options["outer"]]
    if words[:1] == ["w0"]:
        options["warmup"], words = 0, words[1:]
    if words and words[0] in SELECTORS and len(words) >= 2 and words[1].startswith("d="):
        try:
            options["density"] = float(words[1][2:])
        except ValueError:
            return None
        options["selector"], options["accumulators"], words = words[0], "sparse", words[2:]
        if words[:1] == ["fp16"]:
            options["value_dtype"], words = "float16", words[1:]
    if words and words[0].startswith("acc=") and "selector" in options:
        spec = words[0][4:]
        kind = spec.rstrip("0123456789")
        if kind not in ("sparse", "dense") or spec[len(kind):].startswith("0"):
            return None
        options["accumulators"], words = spec, words[1:]
    return None if words else options


def run_named(name):
    """The run a table row's name stands for: ``sync AdaGrad``, ``LAA H=<h> <rule>[ outer]`` or ``local SGD
    H=<h>``, so that ``--only`` can ask for any period, not only the defaults'."""
    if name == "sync AdaGrad":
        return run_config(name, "sync")
    try:
        family, h = family_and_period(name)
    except ValueError:  # H= followed by something else than a number
        family, h = name, 0
    words = family.split()
    if h > 0 and family == "local SGD":
        return run_config(name, "local_sgd", h)
    if h > 0 and words[:2] == ["local", "SGD"] and (options := _options_of(words[2:])) and "selector" in options:
        options.pop("accumulators")
        return run_config(name, "local_sgd", h, **options)
    if h > 0 and words[:1] == ["LAA"] and len(words) >= 2 and words[1] in RULES and \
            (options := _options_of(words[2:])) is not None:
        return run_config(name, "laa", h, words[1], **options)
    raise ValueError(f"--only: {name!r} names no run; the forms are 'sync AdaGrad', 'LAA H=<h> <rule> [w0] "
                     f"[<selector> d=<density> [fp16] [acc=sparse|sparseN|dense|denseN]] [outer]' (rule one of {', '.join(RULES)}, "
                     f"selector one of {', '.join(SELECTORS)}), 'local SGD H=<h>', 'local SGD H=<h> [w0] "
                     f"<selector> d=<density> [outer]', h a positive integer")


def default_runs(periods=(4, 8, 16), rules=RULES, outer_rule="rate",
                 outer_periods=(8, 16, 32, 64, 128, 256)):
    runs = [run_config("sync AdaGrad", "sync")]
    for rule in rules:
        runs += [run_config(f"LAA H={h} {rule}", "laa", h, rule)
                 for h in periods + ((32, 64, 128, 256) if rule == "rate" else ())]
    runs += [run_config(f"LAA H={h} {outer_rule} outer", "laa", h, outer_rule, True) for h in outer_periods]
    runs += [run_config(f"local SGD H={h}", "local_sgd", h) for h in periods]
    return runs


def build(ddp, run, hp):
    """The run's optimizer and a function to call after each optimizer step."""
    if run["kind"] == "sync":
        return build_sync_adagrad(ddp, lr=hp["lr"], eps=hp["eps"])[1], None
    sparse = None if run["selector"] is None else SparseAverage(method=run["selector"], density=run["density"],
                                                                value_dtype=run["value_dtype"])
    if run["kind"] == "laa":
        outer = dict(outer_lr=0.7, outer_momentum=0.9) if run["outer"] else {}
        acc = run["accumulators"]
        kind = acc.rstrip("0123456789")
        every = int(acc[len(kind):] or 1)
        return build_local_adaalter(ddp, lr=hp["lr"], eps=hp["eps"], period=run["period"],
                                    warmup_steps=run["warmup"], lazy_correction=run["rule"], sparse=sparse,
                                    accumulator_period=every * run["period"],
                                    compress_accumulators=kind == "sparse", **outer)[1], None
    if sparse is None:
        _, opt, averager = build_local_sgd(ddp, lr=hp["sgd_lr"], period=run["period"], warmup_steps=WARMUP,
                                           momentum=0.9)
        return opt, lambda: averager.average_parameters(ddp.parameters())
    state = plsgd.PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=run["warmup"],
                                    post_local_gradient_allreduce=False)
    ddp.register_comm_hook(state, plsgd.post_localSGD_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=hp["sgd_lr"], momentum=0.9)
    averager = AdaAlterAverager(period=run["period"], warmup_steps=run["warmup"], sparse=sparse,
                                outer=OuterSGD(lr=0.7, momentum=0.9) if run["outer"] else None)
    if run["warmup"] == 0:  # the round's start: DDP broadcast the same parameters to every rank
        averager.anchor_keeper.set_anchor(list(ddp.parameters()))
    return opt, lambda: averager.average_parameters(ddp.parameters())


def load(task, world, quick):
    """Per-task data, the model factory, a batch function and the metric (higher is better for accuracy)."""
    steps = STEPS_TOTAL // world
    if task == "fashion-mnist":
        train_x, train_y, test_x, test_y = read_fashion_mnist(find_fashion_mnist(None))
        scale = lambda x: ((x.float() / 255.0 - 0.2860) / 0.3530).unsqueeze(1)  # noqa: E731
        n = steps * 32 * world
        xs, ys = scale(train_x[:n]), train_y[:n]
        if quick:
            test_x, test_y = test_x[:2000], test_y[:2000]
        tx, ty = scale(test_x), test_y
        return dict(examples=(xs, ys), make=cnn, loss=lambda m, b: F.cross_entropy(m(b[0]), b[1]),
                    metric=lambda m: evaluate(m, tx, ty))
    train, valid, alphabet = load_fortunes()
    windows = train[:CHARS_TRAIN].view(-1, SEQ)  # 12,288 windows of 64 characters
    nvalid = CHARS_VALID // (8 if quick else 1)
    vwin = valid[:nvalid + 1]
    vx, vy = vwin[:-1].view(-1, SEQ), vwin[1:].view(-1, SEQ)
    nexts = train[1:CHARS_TRAIN + 1].view(-1, SEQ)
    vocab = len(alphabet)

    def perplexity(model):
        with torch.no_grad():
            total = sum(F.cross_entropy(model(vx[i:i + 256]).reshape(-1, vocab), vy[i:i + 256].reshape(-1),
                                        reduction="sum").item() for i in range(0, len(vx), 256))
        return math.exp(total / vy.numel())

    return dict(examples=(windows, nexts), make=lambda seed: char_lstm(vocab, seed),
                loss=lambda m, b: F.cross_entropy(m(b[0]).reshape(-1, vocab), b[1].reshape(-1)), metric=perplexity)


def train_one(rank, world, task, data, run, args, seed):
    xs, ys = data["examples"]
    xs, ys = rank_shard(xs, ys, rank, world)
    shard = len(ys)
    ddp = DDP(data["make"](seed))
    opt, after_step = build(ddp, run, args.hp)
    steps = STEPS_TOTAL // world
    curve, losses = [], []
    start = time.perf_counter()
    for epoch in range(args.epochs):
        order = epoch_order(shard, seed, rank, epoch)
        losses = []
        for s in range(steps):
            idx = order[s * 32:(s + 1) * 32]
            opt.zero_grad(set_to_none=True)
            loss = data["loss"](ddp, (xs[idx], ys[idx]))
            loss.backward()
            opt.step()
            if after_step is not None:
                after_step()
            losses.append(loss.item())
        curve.append(round(data["metric"](_averaged(ddp.module, world)), 3 if task == "fortunes" else 2))
    return {"seed": seed, "name": run["name"], "metric": curve[-1], "curve": curve,
            "last_epoch_loss": sum(losses) / len(losses), "syncs_per_epoch": COUNT["all_reduce"] / args.epochs,
            "bytes_per_step": COUNT["bytes"] / (steps * args.epochs), "seconds": round(time.perf_counter() - start, 1)}


COUNT = {"all_reduce": 0, "bytes": 0}
ALL_REDUCE = dist.all_reduce  # the uncounted one, for evaluation
GATHERS = ("all_gather", "all_gather_into_tensor", "all_gather_single")


def _averaged(module, world):
    """``module`` itself where every rank holds the same parameters, else a copy with the ranks' average
    (off the clock, not counted): a run that ends its epochs on an averaging is evaluated bit for bit."""
    if world == 1:
        return module
    with torch.no_grad():
        flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
        high, low = flat.clone(), flat.clone()
        ALL_REDUCE(high, op=dist.ReduceOp.MAX)
        ALL_REDUCE(low, op=dist.ReduceOp.MIN)
    if torch.equal(high, low):
        return module
    averaged = copy.deepcopy(module)
    with torch.no_grad():
        for p in averaged.parameters():
            ALL_REDUCE(p.data)
            p.data.div_(world)
    return averaged


def _bytes_handed(args, kwargs, position):
    tensor = args[position] if len(args) > position else kwargs.get("tensor")
    return tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0


def _count_all_reduce():
    """Wrap ``all_reduce`` (calls and bytes) and the ``all_gather`` family (bytes each rank hands in)."""
    def counted(*a, **k):
        COUNT["all_reduce"] += 1
        COUNT["bytes"] += _bytes_handed(a, k, 0)
        return ALL_REDUCE(*a, **k)

    dist.all_reduce = counted
    broadcast = dist.broadcast

    def broadcast_counted(*a, **k):  # shared top-k's positions: counted on the rank that sends them
        src = a[1] if len(a) > 1 else k.get("src")
        if src == dist.get_rank():
            COUNT["bytes"] += _bytes_handed(a, k, 0)
        return broadcast(*a, **k)

    dist.broadcast = broadcast_counted
    for name in GATHERS:
        original = getattr(dist, name, None)
        if original is not None:
            def gathered(*a, _original=original, **k):
                COUNT["bytes"] += _bytes_handed(a, k, 1)
                return _original(*a, **k)
            setattr(dist, name, gathered)


def body(rank, world, task, runs, args, seeds):
    torch.set_num_threads(1)
    data = load(task, world, args.quick)
    _count_all_reduce()
    results = []
    for seed in seeds:
        for run in runs:
            COUNT["all_reduce"] = COUNT["bytes"] = 0
            result = train_one(rank, world, task, data, run, args, seed)
            if rank == 0:
                print(json.dumps(result), flush=True)
            results.append(result)
    return results


def main(argv=None):
    args = parse_args(argv)
    if args.report:
        return report(args.report, args.merge)
    runs = [run_named(name) for name in args.only] if args.only else default_runs(outer_rule=args.outer_rule)
    seeds = list(range(args.seed_start, args.seed_start + args.seeds))
    command = shlex.join(["python", "bench/bench_adaalter_convergence.py",
                          *(argv if argv is not None else sys.argv[1:])])
    start = time.perf_counter()
    results = run_distributed(body, args.world, args.task, runs, args, seeds, timeout=3 * 3600)[0]
    hp = args.hp
    header = (f"{args.task}, {args.world} ranks, {args.epochs} epochs of {STEPS_TOTAL // args.world} steps, "
              f"warm-up {WARMUP} steps; AdaGrad/AdaAlter lr {hp['lr']} eps {hp['eps']}, local SGD lr "
              f"{hp['sgd_lr']} momentum 0.9; seeds {seeds}; {time.perf_counter() - start:.0f} s")
    print(f"\n$ {command}\n{header}\n\n{table(results, args.task)}")
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps({"command": command, "header": header, "task": args.task}) + "\n")
            for r in results:
                f.write(json.dumps(r) + "\n")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--task", choices=sorted(TASKS), default="fashion-mnist", help="data and model")
    p.add_argument("--world", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--quick", action="store_true", help="1 seed, 1 epoch, a smaller test set: a smoke run")
    p.add_argument("--only", nargs="+", default=None, help="only these runs, by their rows' names (any period H)")
    p.add_argument("--seeds", type=int, default=None, help="number of seeds (default 3, quick 1)")
    p.add_argument("--seed-start", type=int, default=0, help="first seed (default 0)")
    p.add_argument("--epochs", type=int, default=None, help="epochs (default 4, quick 1)")
    p.add_argument("--outer-rule", choices=("paper", "constant", "rate"), default="rate", help="lazy correction of the outer-optimizer rows (default rate)")
    p.add_argument("--lr", type=float, default=None, help="AdaGrad's and AdaAlter's lr (default: the task's)")
    p.add_argument("--eps", type=float, default=None, help="AdaGrad's and AdaAlter's eps (default: the task's)")
    p.add_argument("--sgd-lr", type=float, default=None, help="local SGD's lr (default: the task's)")
    p.add_argument("--out", default=None, help="write every run as JSON lines here")
    p.add_argument("--report", nargs="+", default=None, help="print the tables of these results files and stop")
    p.add_argument("--merge", action="store_true", help="with --report: one table, later files replacing rows")
    args = p.parse_args(argv)
    if args.seeds is None:
        args.seeds = 1 if args.quick else 3
    if args.epochs is None:
        args.epochs = 1 if args.quick else 4
    args.hp = dict(TASKS[args.task])
    for key in ("lr", "eps", "sgd_lr"):
        if getattr(args, key) is not None:
            args.hp[key] = getattr(args, key)
    return args


if __name__ == "__main__":
    main()

"""Time to accuracy on a bandwidth-limited cluster: each method, Fashion-MNIST, 4 hosts, 1 Gbit/s and 100 Mbit/s.

Run (from the repository root; the cluster parts need root and iproute2; times measured here)::

    python bench/bench_time_to_accuracy.py --part curves             # 49 min, no root needed
    sudo python bench/bench_time_to_accuracy.py --part step-times    # 4 min
    sudo python bench/bench_time_to_accuracy.py --part wall-clock    # 8 min (random-block d=0.01, both rates)
    sudo python bench/bench_time_to_accuracy.py --part lm-step-times # 35 s (the fortunes LSTM)
    python bench/bench_time_to_accuracy.py --report                  # tables and plot from the files
    sudo python bench/bench_time_to_accuracy.py --quick              # all parts, small

Synchronous training follows the same trajectory at any bandwidth, so each
method's time to the target is a product: its curve (test accuracy against
steps, ``--part curves``: 4 gloo ranks on loopback, ``tta_training``) times
its step time on the simulated cluster at each bandwidth (``--part
step-times``: 4 namespaces shaped with tc, the cluster benchmark's worker
on ``fmnist-cnn`` with 32 images per host and step, each method with the
optimizer settings it trains with; a sparsifier's density warm-up integrated
over the density grid of ``tta_plan``). ``--part wall-clock`` checks the
product: the methods of ``--wall-methods`` (default random-block d=0.01)
train on the shaped cluster itself until they reach the target, at each
bandwidth of ``--wall-bandwidths``, and the report compares the measured
seconds with the product's. ``--part lm-step-times`` times sync AdaGrad and
Local AdaAlter on the fortunes LSTM, whose curves come from the Local
AdaAlter benchmark (``tta_language``).

The target is the allreduce hook's final test accuracy minus 1 point, from
the curves file. Files (``--results``, default ``bench/results/tta``):
``-curves.jsonl``, ``-step-times.jsonl`` (and ``.md``), ``-wall-clock.jsonl``,
``-lm-step-times.jsonl`` (and ``.md``); the report writes ``.md`` and
``.png`` beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(REPO, "recipes"))

from tta_language import LM_SPARSE_CURVES, lm_report, lm_step_time_plan  # noqa: E402
from bench_models import FASHION_MNIST_MODELS  # noqa: E402
from tta_plan import BANDWIDTHS, MODEL, curve_methods, step_time_plan, warmup_candidates  # noqa: E402
from tta_report import plot, read_curves, report, target_of  # noqa: E402
from tta_training import steps_per_epoch, train_curve  # noqa: E402

from ddp_hooks.testing import run_distributed  # noqa: E402

PARTS = ("curves", "step-times", "wall-clock", "lm-step-times")


def chosen_methods(args) -> list:
    """The plan's curve methods, or those of ``--only``, which may also name the warm-up candidates (an unknown
    label is refused, with the plan's labels)."""
    methods = curve_methods(args.quick)
    if not args.only:
        return methods
    methods += warmup_candidates()
    unknown = sorted(set(args.only) - {m.label for m in methods})
    if unknown:
        raise SystemExit(f"--only: {unknown} not in the plan; its labels: {[m.label for m in methods]}")
    return [m for m in methods if m.label in args.only]


def run_curves(args, path: str) -> None:
    """Train every method of the plan on loopback; one JSON line per method after a header line."""
    methods = chosen_methods(args)
    if not (args.append and os.path.exists(path)):
        with open(path, "w") as f:
            f.write(json.dumps({"command": args.command, "train": args.train, "epochs": args.epochs,
                                "eval_every": args.eval_every, "world": args.world, "model": args.model}) + "\n")
    for method in methods:
        spec = {"method": method.as_dict(), "model": args.model, "epochs": args.epochs, "train": args.train,
                "eval_every": args.eval_every, "seed": args.seed, "data_dir": args.data_dir, "stop_at": None}
        start = time.perf_counter()
        result = run_distributed(train_curve, args.world, spec, timeout=3600)[0]
        result["wall_s"] = round(time.perf_counter() - start, 1)
        result["command"] = args.command
        last = result["curve"][-1]
        print(f"{method.label:<24} {last['accuracy']:6.2f} % after {last['step']} steps, {result['wall_s']:.0f} s",
              flush=True)
        with open(path, "a") as f:
            f.write(json.dumps(result) + "\n")


def run_step_times_part(args, path: str, language: bool = False) -> None:
    from tta_cluster import run_step_times  # needs root; imported here so that the other parts do not

    plan = (lm_step_time_plan(args.rounds) if language
            else step_time_plan(chosen_methods(args), args.rounds, args.model))
    run_step_times(plan, path, args.command, append=args.append)
    print(f"step times: {path}", flush=True)


def run_wall_clock_part(args, curves_path: str, path: str) -> None:
    """Each method of ``--wall-methods`` trained on the shaped cluster to the target of the curves file, at each
    bandwidth of ``--wall-bandwidths``; with ``--append`` the results join those already in ``path``."""
    from tta_cluster import run_wall_clock

    header, results = read_curves(curves_path)
    target = target_of(results)
    by_label = {m.label: m for m in curve_methods(args.quick)}
    unknown = [label for label in args.wall_methods if label not in by_label]
    if unknown:
        raise SystemExit(f"--wall-methods: {unknown} not in the plan; its labels: {sorted(by_label)}")
    if not (args.append and os.path.exists(path)):
        with open(path, "w") as f:
            f.write(json.dumps({"command": args.command, "target": target}) + "\n")
    for label in args.wall_methods:
        for bandwidth in args.wall_bandwidths:
            spec = {"method": by_label[label].as_dict(), "model": header.get("model", MODEL),
                    "epochs": header["epochs"], "train": header["train"],
                    "eval_every": header["eval_every"], "seed": args.seed, "data_dir": args.data_dir,
                    "stop_at": target}
            result = run_wall_clock(spec, bandwidth)
            result["command"] = args.command
            last = result["curve"][-1]
            print(f"wall clock {bandwidth}: {label} {last['accuracy']:.2f} % at step {last['step']}, "
                  f"{last['train_s']:.0f} s", flush=True)
            with open(path, "a") as f:
                f.write(json.dumps(result) + "\n")


def write_report(args) -> None:
    curves, step_times, walls = (args.results + suffix for suffix in ("-curves.jsonl", "-step-times.jsonl",
                                                                      "-wall-clock.jsonl"))
    step_times = args.step_times or step_times
    missing = [path for path in (curves, step_times) if not os.path.exists(path)]
    if missing:
        print(f"no report yet: {' and '.join(missing)} missing (run --part curves and step-times)")
        return
    wall_results = read_curves(walls)[1] if os.path.exists(walls) else []
    text = report(curves, step_times, wall_results)
    if os.path.exists(args.results + "-lm-step-times.jsonl"):
        text += "\n" + "\n".join(["### Local AdaAlter against sync AdaGrad: time to a validation perplexity", ""]
                                 + lm_report(args.results + "-lm-step-times.jsonl")) + "\n"
        if os.path.exists(LM_SPARSE_CURVES):
            text += "\n" + "\n".join(["### Sparse synchronisation against sync AdaGrad: time to a validation "
                                       "perplexity", ""]
                                      + lm_report(args.results + "-lm-step-times.jsonl", LM_SPARSE_CURVES)) + "\n"
    with open(args.results + ".md", "w") as f:
        f.write(text)
    plot(curves, step_times, args.results + ".png")
    print(text + f"\ntables: {args.results}.md, plot: {args.results}.png")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", choices=PARTS, nargs="+", default=None, help="what to run (default: every part)")
    p.add_argument("--quick", action="store_true", help="2 methods, 1 epoch of 8,000 images: a smoke run")
    p.add_argument("--report", action="store_true", help="print and write the tables and plot, run nothing")
    p.add_argument("--only", nargs="+", default=None,
                   help="curves, step-times: keep only the methods of these labels (step times: and the noop hook)")
    p.add_argument("--results", default=None, help="prefix of the results files (default bench/results/tta, "
                                                    "--quick: bench/results/tta-quick)")
    p.add_argument("--epochs", type=int, default=None, help="epochs (default 4, --quick 1)")
    p.add_argument("--train", type=int, default=None, help="training images (default 48000, --quick 8000)")
    p.add_argument("--eval-every", type=int, default=None, help="steps between evaluations (default: half "
                                                                "an epoch)")
    p.add_argument("--model", default=MODEL, choices=FASHION_MNIST_MODELS,
                   help=f"curves, step-times: the model (default {MODEL}; give the others their own --results)")
    p.add_argument("--world", type=int, default=4, help="curves: ranks (default 4, the cluster's hosts)")
    p.add_argument("--rounds", type=int, default=1, help="step times: rounds of the plan, medians (default 1)")
    p.add_argument("--wall-methods", nargs="+", default=["random-block d=0.01"],
                   help="wall-clock: the methods (labels of the curves) to train on the cluster")
    p.add_argument("--wall-bandwidths", nargs="+", default=list(BANDWIDTHS), choices=BANDWIDTHS,
                   help="wall-clock: the bandwidths (default both)")
    p.add_argument("--append", action="store_true",
                   help="curves, wall-clock, step-times: add to the results file, not replace it")
    p.add_argument("--seed", type=int, default=0, help="seed of initialisation and data order (default 0)")
    p.add_argument("--step-times", default=None,
                   help="--report: the step times to multiply the curves by (default: the results' own); "
                        "curves of another seed take the main run's")
    p.add_argument("--data-dir", default=None, help="Fashion-MNIST folder (default: Debian's)")
    args = p.parse_args(argv)
    args.command = shlex.join(["python", "bench/bench_time_to_accuracy.py", *(sys.argv[1:] if argv is None else argv)])
    args.epochs = args.epochs or (1 if args.quick else 4)
    args.train = args.train or (8000 if args.quick else 48000)
    args.eval_every = args.eval_every or max(1, steps_per_epoch(args.train, args.world) // 2)
    args.results = args.results or os.path.join(REPO, "bench", "results", "tta-quick" if args.quick else "tta")
    args.part = args.part or ([] if args.report else list(PARTS))
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if "curves" in args.part:
        run_curves(args, args.results + "-curves.jsonl")
    if "step-times" in args.part:
        run_step_times_part(args, args.results + "-step-times.jsonl")
    if "wall-clock" in args.part:
        run_wall_clock_part(args, args.results + "-curves.jsonl", args.results + "-wall-clock.jsonl")
    if "lm-step-times" in args.part:
        run_step_times_part(args, args.results + "-lm-step-times.jsonl", language=True)
    if args.report or args.part:
        write_report(args)


if __name__ == "__main__":
    main()

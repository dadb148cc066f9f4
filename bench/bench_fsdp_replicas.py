"""Test accuracy of FSDP2's HSDP with the all-reduce between replicas through the compressor, against FSDP2's own.

Run::

    python bench/bench_fsdp_replicas.py --seeds 3 --out bench/results/fsdp-replicas.jsonl

4 gloo ranks on a (2 replicas x 2 shards) mesh train ``recipes/fsdp_replicas.py``'s
CNN on Fashion-MNIST (each rank its own quarter of ``--train`` images, 32 per
step, 8 epochs, momentum SGD with weight decay and cosine decay) with
``--replicas dense`` (FSDP2's HSDP) and with ``SparseReplicas`` at each
selector and density. Cells: final test accuracy on the 10,000 test images,
the mean over seeds with half the range, and the gap to dense in points.
"""

import argparse
import json
import os
import shlex
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "recipes"))

from ddp_hooks.testing import run_distributed  # noqa: E402
from fsdp_replicas import parse_args as example_args, train  # noqa: E402

ROWS = [("dense HSDP", ["--replicas", "dense"])] + [
    (f"{method} d={density:g}", ["--method", method, "--density", str(density)])
    for density in (0.01,) for method in ("random_block", "shared_topk")]


def _one(rank, world, flags):
    return train(rank, world, example_args(flags))


def table(results) -> str:
    by_name = {}
    for r in results:
        by_name.setdefault(r["name"], []).append(r["accuracy"])
    dense = by_name.get("dense HSDP")
    dense_mean = sum(dense) / len(dense) if dense else None
    lines = ["| run | test accuracy | gap to dense HSDP |", "|---|---|---|"]
    for name, values in by_name.items():
        mean = sum(values) / len(values)
        spread = f" ±{(max(values) - min(values)) / 2:.2f}" if len(values) > 1 else ""
        gap = "" if dense_mean is None or name == "dense HSDP" else f"{mean - dense_mean:+.2f}"
        lines.append(f"| {name} | {mean:.2f}{spread} | {gap} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=3, help="seeds (default 3)")
    p.add_argument("--epochs", type=int, default=8, help="epochs (default 8)")
    p.add_argument("--train", type=int, default=24000, help="training images (default 24000)")
    p.add_argument("--only", nargs="+", default=None, help="keep only these rows")
    p.add_argument("--out", default=None, help="JSON lines of every run")
    p.add_argument("--report", default=None, help="print the table of a results file and stop")
    args = p.parse_args()
    if args.report:
        with open(args.report) as f:
            lines = [json.loads(line) for line in f if line.strip()]
        print(lines[0]["command"], "\n")
        print(table(lines[1:]))
        return
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    rows = [row for row in ROWS if args.only is None or row[0] in args.only]
    results, start = [], time.perf_counter()
    for seed in range(args.seeds):
        for name, flags in rows:
            flags = flags + ["--seed", str(seed), "--epochs", str(args.epochs), "--train", str(args.train)]
            out = run_distributed(_one, 4, flags, timeout=3600)[0]
            results.append({"name": name, "seed": seed, **out})
            print(json.dumps(results[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps({"command": command, "seconds": round(time.perf_counter() - start)}) + "\n")
            for r in results:
                f.write(json.dumps(r) + "\n")
    print(f"\n$ {command}\n")
    print(table(results))


if __name__ == "__main__":
    main()

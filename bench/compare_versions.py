"""This tree's benchmarks against another version's, run alternately on the same machine: is a change slower?

A refactor must not slow the hook down. Timing the two versions at different
times compares the machine's drift as much as the code, so this runs each
version's own benchmark in turn, several times, alternating, and compares
the medians over the rounds:

* ``kernels``: each version's ``bench/bench_sparsify_kernels.py``; per row,
  its minimum time over its own interleaved ``add_`` floor (``x floor``).
* ``calls``: each version's kernel-benchmark bucket, 1 MB, where a call's
  fixed costs weigh most and 15 rounds are too few: the median of 300 hook
  calls per row, in microseconds.
* ``cluster``: each version's ``bench/bench_cluster.py --quick`` (root, network
  namespaces); per sparsifier row, the time inside the hook calls
  (``compression s``) and the seconds per step.

The other version is a folder holding its tree, e.g. one made with
``git archive 396a782 | tar -x -C /tmp/before``; its benchmarks import its own
``ddp_hooks`` (``PYTHONPATH``)::

    python bench/compare_versions.py kernels --other /tmp/before --rounds 3
    python bench/compare_versions.py calls --other /tmp/before --rounds 3
    sudo python bench/compare_versions.py cluster --other /tmp/before --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
THIS = os.path.dirname(HERE)


def _run(tree: str, argv: List[str]) -> None:
    env = dict(os.environ, PYTHONPATH=tree)
    subprocess.run([sys.executable, *argv], cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)


def kernel_rows(tree: str, out: str) -> Dict[str, float]:
    """Run ``tree``'s kernel benchmark; each hook row's min time over its own floor's."""
    _run(tree, ["-m", "pytest", "bench/bench_sparsify_kernels.py", "-p", "no:cacheprovider", "-q",
                "-k", "test_hook or test_scan", f"--benchmark-json={out}"])
    with open(out) as f:
        benchmarks = json.load(f)["benchmarks"]
    return {b["name"]: b["stats"]["min"] / b["extra_info"]["own_floor_min_s"] for b in benchmarks
            if "own_floor_min_s" in b["extra_info"]}


_CALLS = """
import contextlib, json, statistics, sys, time, torch
sys.path.insert(0, "bench")
torch.set_num_threads(1)
import bench_sparsify_kernels as kernels
# a version whose compressor always runs its collective times it as its kernel benchmark does: completing at once
held = contextlib.ExitStack()  # entered for the whole run
held.enter_context(getattr(kernels, "instant_collectives", contextlib.nullcontext)())
bucket_class = getattr(kernels, "KernelBucket", None) or getattr(kernels, "_Bucket")  # (its name before issue 17)
rows = {}
for config in [("random_block", "layer", "allreduce"), ("topk", "bucket", "allgather"), ("randomk", "bucket", "allreduce")]:
    for density in (0.01, 0.1):
        bucket = bucket_class(1, density, *config)
        bucket.refill()
        bucket.hook_work()
        times = []
        for _ in range(300):
            bucket.refill()
            start = time.perf_counter()
            bucket.hook_work()
            times.append(time.perf_counter() - start)
        rows["1MB-%g-%s" % (density, "-".join(config))] = statistics.median(times) * 1e6
json.dump(rows, open(sys.argv[1], "w"))
"""


def call_rows(tree: str, out: str) -> Dict[str, float]:
    """Median microseconds of 300 hook calls on 1 MB buckets, with ``tree``'s kernel-benchmark bucket."""
    _run(tree, ["-c", _CALLS, out])
    with open(out) as f:
        return json.load(f)


def cluster_rows(tree: str, out: str) -> Dict[str, float]:
    """Run ``tree``'s quick cluster benchmark; per sparsifier row, compression s and s/step."""
    _run(tree, ["bench/bench_cluster.py", "--quick", "--out", out])
    rows = {}
    with open(out) as f:
        for line in f:
            r = json.loads(line)
            if r.get("hook") == "sparsify":
                name = f"{r['model']} {r['hosts']}h {r['bandwidth']} {r['label']} {r['density']:g} {r['scope']}"
                rows[f"{name}: compression s"] = r["compression_s"]
                rows[f"{name}: s/step"] = r["s_per_step"]
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["kernels", "calls", "cluster"])
    p.add_argument("--other", required=True, help="the folder holding the other version's tree")
    p.add_argument("--rounds", type=int, default=3, help="runs of each version, alternating (default 3)")
    args = p.parse_args()
    measure = {"kernels": kernel_rows, "calls": call_rows, "cluster": cluster_rows}[args.what]
    results = {"other": defaultdict(list), "this": defaultdict(list)}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for label, tree in (("other", os.path.abspath(args.other)), ("this", THIS)):
                rows = measure(tree, os.path.join(tmp, f"{label}-{round_}.json"))
                for name, value in rows.items():
                    results[label][name].append(value)
                print(f"round {round_ + 1}/{args.rounds}: {label} done", file=sys.stderr)
    unit = {"kernels": "x floor", "calls": "microseconds", "cluster": "seconds"}[args.what]
    print(f"$ python bench/compare_versions.py {args.what} --other {args.other} --rounds {args.rounds}\n")
    print(f"| row | other ({unit}, median) | this | this / other |")
    print("|---|---|---|---|")
    ratios = []
    for name in sorted(set(results["other"]) & set(results["this"])):
        old, new = (statistics.median(results[k][name]) for k in ("other", "this"))
        ratios.append(new / old)
        print(f"| {name} | {old:.3f} | {new:.3f} | {new / old:.2f} |")
    print(f"\nGeometric mean of this / other over {len(ratios)} rows: "
          f"{statistics.geometric_mean(ratios):.3f}")


if __name__ == "__main__":
    main()

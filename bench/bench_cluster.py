"""End-to-end DDP benchmark on a simulated, bandwidth-limited cluster on this machine (needs root, iproute2).

Run (from the repository root)::

    sudo python bench/bench_cluster.py --quick     # under 3 minutes
    sudo python bench/bench_cluster.py             # every configuration of issue 6, under 30 minutes

N hosts are network namespaces on a private bridge (``bench/cluster.py``),
shaped with tc to each bandwidth in turn; one training process per host
(``bench/cluster_worker.py``) over gloo on the host's own interface. For every
(hosts, model, bandwidth) it prints a markdown table: seconds per step,
speed-up over PyTorch's allreduce hook in the same run, payload bytes per
step and rank (the recipe's counters), bytes on the wire per step and host
(the interface's ``tx_bytes``), and the split of a step into forward,
backward, exchange, compression and optimizer (``cluster_worker.PHASES``).
Raw results go to a JSON-lines file, the tables to a markdown file.

Each host process uses one CPU thread and a fixed synthetic batch (timing
only). The processes stay up for all methods of a host count; the controller
reshapes the network between windows when the ranks ask for it.

The batch is small on purpose (4 CIFAR-sized images per host by default):
the hosts share this machine's cores and compute far slower than a GPU, so a
GPU-sized batch would make every configuration compute-bound, which is not
the regime the methods are for. ``--batch`` moves the balance; the ratio of
compute to communication decides where compression pays.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import OrderedDict
from typing import Dict, List, Optional, Sequence, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(REPO, "recipes"))

from cluster import Cluster, ClusterError, IFNAME, check_prerequisites, exit_on_signals, parse_rate  # noqa: E402
from cluster_control import ack_path, pending_request, write_atomic  # noqa: E402
from cluster_plan import (ADAALTER, BANDWIDTHS, FP16, NOOP, POWERSGD, SYNC_ADAGRAD, Method, Run,  # noqa: E402
                          full_plan, headline_plan, quick_plan, repeat, shared_topk_plan, sparsifier,
                          summary_methods)
from run_metrics import format_bytes  # noqa: E402

PORT = 29500  # inside host 0's namespace: nothing else listens there


def _tail(path: str, lines: int = 30) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return "(no log)"


class _Progress:
    """Prints the records the ranks append to the results file from now on, as they come."""

    def __init__(self, path: str):
        self.path, self.offset = path, os.path.getsize(path)

    def poll(self) -> None:
        with open(self.path) as f:
            f.seek(self.offset)
            chunk = f.read()
        end = chunk.rfind("\n") + 1
        self.offset += len(chunk[:end].encode())
        for line in chunk[:end].splitlines():
            r = json.loads(line)
            print(f"  {r['model']:<8} {r['hosts']} hosts {r['bandwidth']:>8}  {_method_name(r):<42} "
                  f"{r['s_per_step']:7.3f} s/step  {format_bytes(r['wire_bytes_per_step']):>9} wire/step", flush=True)


def run_host_count(cluster: Cluster, hosts: int, runs: List[Run], args, port: int) -> None:
    """Start one worker per host for ``runs`` and answer their bandwidth requests until they finish."""
    folder = tempfile.mkdtemp(prefix="ddphb-ctl-")
    plan = {"runs": [{"model": r.model, "bandwidths": list(r.bandwidths), "round": r.round,
                      "methods": [m.as_dict() for m in r.methods]} for r in runs],
            "steps": args.steps, "min_window_s": args.min_window, "batch": args.batch, "image_size": args.image_size,
            "timeout": args.timeout, "out": os.path.abspath(args.out)}
    write_atomic(os.path.join(folder, "plan.json"), json.dumps(plan))
    procs, logs = [], []
    for rank in range(hosts):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(hosts), MASTER_ADDR=cluster.address(0),
                   MASTER_PORT=str(port), GLOO_SOCKET_IFNAME=IFNAME, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
        logs.append(os.path.join(folder, f"host{rank}.log"))
        with open(logs[-1], "w") as log:
            procs.append(cluster.popen(rank, [sys.executable, os.path.join(HERE, "cluster_worker.py"), folder],
                                       env=env, stdout=log, stderr=log))
    progress, keep = _Progress(args.out), False
    try:
        _serve(cluster, procs, logs, folder, progress)
    except RuntimeError:
        keep = True  # the hosts' logs
        raise
    finally:
        if not keep:
            shutil.rmtree(folder, ignore_errors=True)


def _serve(cluster: Cluster, procs, logs: List[str], folder: str, progress: "_Progress") -> None:
    """Apply the ranks' bandwidth requests until every host exits; RuntimeError when one fails."""
    seq, next_poll = 0, 0.0
    while True:
        rate = pending_request(folder, seq)
        if rate is not None:
            cluster.set_rate(rate)
            write_atomic(ack_path(folder, seq), "")
            seq += 1
            continue
        codes = [p.poll() for p in procs]
        for rank, code in enumerate(codes):
            if code not in (None, 0):
                raise RuntimeError(f"host {rank} of {len(procs)} exited with code {code}; the end of its log "
                                   f"({logs[rank]}):\n{_tail(logs[rank])}")
        if time.monotonic() > next_poll or all(c == 0 for c in codes):
            progress.poll()
            next_poll = time.monotonic() + 0.5
        if all(c == 0 for c in codes):
            return
        time.sleep(0.002)


# ----- tables -----
def _method_name(r: dict) -> str:
    if r["hook"] == "sparsify":
        return f"{r['label']} d={r['density']:g} {r['scope']} {r['aggregation']}"
    return r["label"]


def _options(r: dict) -> str:
    return f"{r['density']:g}, {r['scope']}, {r['aggregation']}" if r["hook"] == "sparsify" else ""


def read_results(path: str) -> Tuple[List[dict], Optional[dict]]:
    """The result records of a results file, and its closing ``{"run": {...}}`` line (None if it has none)."""
    with open(path) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    run = next((line["run"] for line in lines if "run" in line), None)
    return [line for line in lines if "run" not in line], run


_MEDIAN_FIELDS = ("s_per_step", "s_per_step_max_rank", "payload_bytes_per_step", "wire_bytes_per_step",
                  "dense_bytes_per_step", "forward_s", "backward_s", "exchange_s", "compression_s", "optimizer_s")
_METHOD_FIELDS = tuple(Method.__dataclass_fields__)


def merge_rounds(records: Sequence[dict]) -> List[dict]:
    """One record per (model, hosts, bandwidth, method): the median of each measured field over the rounds,
    with ``rounds`` and ``s_per_step_rounds`` (every round's s/step) added."""
    groups: "OrderedDict[tuple, List[dict]]" = OrderedDict()
    for r in records:
        key = (r["model"], r["hosts"], r["bandwidth"]) + tuple(r.get(f) for f in _METHOD_FIELDS)
        groups.setdefault(key, []).append(r)
    merged = []
    for rows in groups.values():
        out = dict(rows[0])
        for name in _MEDIAN_FIELDS:
            out[name] = statistics.median(r[name] for r in rows)
        out["rounds"], out["s_per_step_rounds"] = len(rows), [r["s_per_step"] for r in rows]
        merged.append(out)
    return merged


def _bandwidth_key(bandwidth: str) -> float:
    bits = parse_rate(bandwidth)
    return float("inf") if bits is None else bits


def group_records(records: Sequence[dict]) -> "OrderedDict[tuple, List[dict]]":
    """Records by (model, hosts, bandwidth): models in order of appearance, hosts ascending, slowest first."""
    models = list(OrderedDict.fromkeys(r["model"] for r in records))
    groups: "OrderedDict[tuple, List[dict]]" = OrderedDict()
    for r in sorted(records, key=lambda r: (models.index(r["model"]), r["hosts"], _bandwidth_key(r["bandwidth"]))):
        groups.setdefault((r["model"], r["hosts"], r["bandwidth"]), []).append(r)
    return groups


def baseline(rows: Sequence[dict]) -> Optional[float]:
    """Seconds per step of the allreduce hook: the mean of its rows (the full plan measures it first and last)."""
    times = [r["s_per_step"] for r in rows if r["hook"] == "allreduce" and r["optimizer"] == "sgd"]
    return sum(times) / len(times) if times else None


def ceiling(rows: Sequence[dict]) -> Optional[float]:
    """Seconds per step of the noop hook (no exchange at all): the least any hook can take, or None."""
    times = [r["s_per_step"] for r in rows if r["hook"] == "noop"]
    return sum(times) / len(times) if times else None


def format_table(rows: Sequence[dict]) -> str:
    """A markdown table of one (model, hosts, bandwidth); speed-up against the allreduce hook's row, and
    s/step over the noop hook's (1.00x: all communication hidden), where the run measured it."""
    base, noop_seconds = baseline(rows), ceiling(rows)
    header = ("method", "density, scope, aggregation", "s/step", "speed-up") + (("x noop",) if noop_seconds else ()) + (
        "payload/step/rank", "wire/step/host", "forward s", "backward s", "exchange s", "compression s",
        "optimizer s")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        speedup = f"{base / r['s_per_step']:.2f}x" if base else "n/a"
        seconds = f"{r['s_per_step']:.3f}"
        if r.get("rounds", 1) > 1:
            seconds += f" ({min(r['s_per_step_rounds']):.2f}-{max(r['s_per_step_rounds']):.2f})"
        over_noop = (f"{r['s_per_step'] / noop_seconds:.2f}x",) if noop_seconds else ()
        cells = (r["label"], _options(r), seconds, speedup, *over_noop, format_bytes(r["payload_bytes_per_step"]),
                 format_bytes(r["wire_bytes_per_step"]), *(f"{r[f'{p}_s']:.3f}" for p in
                                                           ("forward", "backward", "exchange", "compression",
                                                            "optimizer")))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# (column, method) of the summary: PyTorch's hooks, each sparsifier at 0.01 with its default scope, Local AdaAlter
SUMMARY = (("noop (ceiling)", NOOP), ("fp16", FP16), ("PowerSGD r1", POWERSGD[1]), ("PowerSGD r4", POWERSGD[4]),
           ("top-k 0.01", sparsifier("topk", 0.01, "layer", "allgather")),
           ("random-k 0.01", sparsifier("randomk", 0.01, "layer", "allreduce")),
           ("random-block 0.01", sparsifier("random_block", 0.01, "layer", "allreduce")),
           ("shared top-k 0.01", sparsifier("shared_topk", 0.01, "layer", "allreduce")),
           ("sync AdaGrad", SYNC_ADAGRAD), ("AdaAlter H=4", ADAALTER[4]), ("AdaAlter H=8", ADAALTER[8]))


_OPTIMIZER_SETTINGS = ("momentum", "weight_decay")  # how a method's optimizer is set, not which method it is


def _is(record: dict, method: Method) -> bool:
    """Whether ``record`` measured ``method`` (at any momentum and weight decay; fields older records lack take
    their defaults)."""
    defaults = {name: f.default for name, f in Method.__dataclass_fields__.items()}
    return all(record.get(k, defaults[k]) == v for k, v in method.as_dict().items() if k not in _OPTIMIZER_SETTINGS)


def format_summary(records: Sequence[dict]) -> str:
    """One line per (model, hosts, bandwidth): the allreduce hook's s/step (mean; each of its measurements in
    brackets) and the speed-ups of the others over that mean."""
    header = ("model", "hosts", "bandwidth", "allreduce s/step") + tuple(c for c, _ in SUMMARY) + (
        "fastest sparsifier",)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for (model, hosts, bandwidth), rows in group_records(records).items():
        base = baseline(rows)
        if base is None:
            continue
        runs = [r["s_per_step"] for r in rows if r["hook"] == "allreduce" and r["optimizer"] == "sgd"]
        cells = [model, str(hosts), bandwidth, f"{base:.3f}" + (
            f" ({', '.join(f'{t:.2f}' for t in runs)})" if len(runs) > 1 else "")]
        for _, method in SUMMARY:
            row = next((r for r in rows if _is(r, method)), None)
            cells.append(f"{base / row['s_per_step']:.2f}x" if row else "")
        sparse = [r for r in rows if r["hook"] == "sparsify"]
        best = min(sparse, key=lambda r: r["s_per_step"]) if sparse else None
        cells.append(f"{base / best['s_per_step']:.2f}x {_method_name(best)}" if best else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_header(run: Optional[dict], records: Sequence[dict]) -> str:
    if run is None:
        return f"{len(records)} results of an unfinished run (no closing line)."
    rounds = run.get("rounds", 1)
    return (f"Command: `{run['command']}`; {len(records)} results in {run['wall_s']:.0f} s; batch {run['batch']} "
            f"images of {run['image_size']}x{run['image_size']} per host, 1 thread per host; timed windows of at "
            f"least {run['steps']} steps and {run['min_window_s']:g} s (Local AdaAlter: whole periods); CPU gloo."
            + (f" {rounds} rounds: every figure is the median over the rounds; s/step shows their range in "
               "brackets." if rounds > 1 else ""))


def format_report(records: Sequence[dict], run: Optional[dict]) -> str:
    header = format_header(run, records)
    records = merge_rounds(records)
    parts = [header, "", "### Speed-up over the allreduce hook", "", format_summary(records),
             "", "Columns: the allreduce hook's seconds per step (the mean of its first and last measurement in the "
             "run, each in brackets; their gap shows how much the machine's speed drifted), then each method's "
             "speed-up over that mean in the same cluster; sparsifiers with scope layer (top-k: allgather, the "
             "others: allreduce)."]
    for (model, hosts, bandwidth), rows in group_records(records).items():
        r0 = rows[0]
        parts.append(f"\n### {model} ({r0['params'] / 1e6:.2f} M parameters), {hosts} hosts, {bandwidth}\n")
        parts.append(format_table(rows))
    parts.append("\n" + format_targets(records))
    return "\n".join(parts) + "\n"


def format_targets(records: Sequence[dict]) -> str:
    """The issue's targets on ResNet-18 with 4 hosts, from the rows measured."""
    lines = ["### Targets (ResNet-18, 4 hosts)", ""]
    need = {"100mbit": 5.0, "1gbit": 375 / 273}
    groups = group_records(records)
    found = False
    for bandwidth, factor in need.items():
        rows = groups.get(("resnet18", 4, bandwidth))
        base = baseline(rows) if rows else None
        if base is None:
            continue
        psgd = next((r for r in rows if r["hook"] == "powersgd" and r["powersgd_rank"] == 4), None)
        for r in rows:
            if r["method"] != "random_block" or r["density"] != 0.01:
                continue
            found = True
            speedup = base / r["s_per_step"]
            line = (f"- {bandwidth}: {_method_name(r)}: {speedup:.2f}x faster than the allreduce hook "
                    f"(target {factor:.2f}x: {'met' if speedup >= factor else 'MISSED'})")
            if psgd is not None:
                line += (f"; vs PowerSGD rank 4: {psgd['s_per_step'] / r['s_per_step']:.2f}x its speed "
                         f"({'met' if r['s_per_step'] <= psgd['s_per_step'] else 'MISSED'}) at "
                         f"{format_bytes(r['wire_bytes_per_step'])} vs "
                         f"{format_bytes(psgd['wire_bytes_per_step'])} on the wire per step and host")
            lines.append(line)
    if not found:
        lines.append("- (no ResNet-18 rows on 4 hosts at 100mbit or 1gbit in this run)")
    lines += ["", "### Against the ceiling (issue 21: random-block d=0.01 within 1.05x of the noop hook's s/step "
              "at 100mbit, 1.10x at 1gbit)", ""]
    measured = False
    for bandwidth, factor in (("100mbit", 1.05), ("1gbit", 1.10)):
        rows = groups.get(("resnet18", 4, bandwidth)) or []
        noop_seconds = ceiling(rows)
        for r in rows:
            if noop_seconds is None or r["method"] != "random_block" or r["density"] != 0.01:
                continue
            measured = True
            ratio = r["s_per_step"] / noop_seconds
            lines.append(f"- {bandwidth}: {_method_name(r)}: {r['s_per_step']:.3f} s/step, {ratio:.2f}x the noop "
                         f"hook's {noop_seconds:.3f} (target {factor:.2f}x: {'met' if ratio <= factor else 'MISSED'}); "
                         f"exchange {r['exchange_s']:.3f} s, compression {r['compression_s']:.3f} s per step")
    if not measured:
        lines.append("- (no noop row beside random-block d=0.01 on ResNet-18 with 4 hosts in this run)")
    return "\n".join(lines)


# ----- command line -----
def build_plan(args) -> Dict[int, List[Run]]:
    """The runs to measure, by host count (one launch of the hosts' processes each)."""
    if args.quick:
        runs = quick_plan()
    elif args.headline:
        runs = headline_plan()
    elif args.shared_topk:
        runs = shared_topk_plan()
    else:
        runs = full_plan(args.hosts, args.models, args.bandwidths, summary_methods() if args.summary_methods else None)
    runs = repeat(runs, args.rounds)
    plan: Dict[int, List[Run]] = {}
    for run in runs:
        plan.setdefault(run.hosts, []).append(run)
    return dict(sorted(plan.items()))


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="a subset under 3 minutes: resnet20 on 2 and 4 hosts with one method of each kind, the "
                        "target rows of resnet18 on 4 hosts; 1gbit and 100mbit (default: every configuration)")
    p.add_argument("--headline", action="store_true",
                   help="only the rows of the targets: resnet18 on 4 hosts, the allreduce hook, random-block at "
                        "0.01 and PowerSGD rank 4 at 1gbit and 100mbit (best with --rounds)")
    p.add_argument("--shared-topk", action="store_true",
                   help="shared top-k against top-k, random-block and the allreduce hook: resnet20 and resnet18 "
                        "on 4 hosts at 1gbit and 100mbit")
    p.add_argument("--summary-methods", action="store_true",
                   help="with --hosts/--models/--bandwidths: one method of each kind (cluster_plan."
                        "summary_methods) instead of every configuration; e.g. for 8 hosts, where each row "
                        "takes twice as long")
    p.add_argument("--rounds", type=int, default=1,
                   help="measure the whole plan this many times; tables show the median over rounds (default: 1)")
    p.add_argument("--hosts", type=int, nargs="+", default=None, help="host counts (default: 2 4)")
    p.add_argument("--models", nargs="+", default=None, choices=("resnet20", "resnet18"),
                   help="models (default: resnet20 resnet18)")
    p.add_argument("--bandwidths", nargs="+", default=None,
                   help="per-host rates each way, tc syntax, or unshaped (default: unshaped 1gbit 100mbit)")
    p.add_argument("--steps", type=int, default=3,
                   help="timed steps per method and bandwidth, at least; Local AdaAlter times whole periods "
                        "(default: 3)")
    p.add_argument("--min-window", type=float, default=0.5,
                   help="seconds a timed window lasts at least; fast steps get more of them (default: 0.5)")
    p.add_argument("--batch", type=int, default=4, help="images per host and step (default: 4)")
    p.add_argument("--image-size", type=int, default=32, help="side of the synthetic images (default: 32)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds a collective or a bandwidth change may take before the run fails (default: 300)")
    p.add_argument("--out", default=None,
                   help="JSON-lines results; the tables go beside it as .md (default: "
                        "bench/results/cluster[-quick].jsonl)")
    p.add_argument("--report", metavar="RESULTS", default=None,
                   help="print the tables of an earlier results file and exit (needs no root)")
    args = p.parse_args(argv)
    chosen = [name for name in ("hosts", "models", "bandwidths") if getattr(args, name) is not None]
    if args.quick + args.headline + args.shared_topk > 1:
        p.error("choose one of --quick, --headline and --shared-topk")
    for name in ("quick", "headline", "shared_topk"):
        if getattr(args, name) and (chosen or args.summary_methods):
            chosen = chosen + ["summary-methods"] * args.summary_methods
            p.error(f"--{name.replace('_', '-')} has its own plan; it does not take --{', --'.join(chosen)}")
    args.hosts = args.hosts or [2, 4]
    args.models = args.models or ["resnet20", "resnet18"]
    args.bandwidths = args.bandwidths or list(BANDWIDTHS)
    for name, low in (("steps", 1), ("batch", 1), ("image_size", 8), ("min_window", 0), ("timeout", 1),
                      ("rounds", 1)):
        if getattr(args, name) < low:
            p.error(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}")
    if any(h < 2 or h > 16 for h in args.hosts):
        p.error(f"--hosts must be between 2 and 16, got {args.hosts}")
    for bandwidth in args.bandwidths:
        try:
            parse_rate(bandwidth)
        except ValueError as exc:
            p.error(f"--bandwidths: {exc}")
    # slowest last: the untimed steps of each method run unshaped, then the rates go down
    args.bandwidths = sorted(set(args.bandwidths), key=_bandwidth_key, reverse=True)
    if args.out is None:
        name = ("cluster-quick" if args.quick else "cluster-headline" if args.headline
                else "cluster-shared-topk" if args.shared_topk else "cluster")
        args.out = os.path.join(REPO, "bench", "results", name + ".jsonl")
    return args


def main(args) -> None:
    if args.report is not None:
        print(format_report(*read_results(args.report)))
        return
    try:
        check_prerequisites()
    except ClusterError as exc:
        raise SystemExit(f"bench_cluster: {exc}")
    plan = build_plan(args)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    open(args.out, "w").close()
    exit_on_signals()
    start = time.perf_counter()
    try:
        with Cluster(max(plan)) as cluster:
            for i, (hosts, runs) in enumerate(plan.items()):
                print(f"{hosts} hosts: {', '.join(r.model for r in runs)}", flush=True)
                run_host_count(cluster, hosts, runs, args, PORT + i)
    except (KeyboardInterrupt, SystemExit):
        print(f"bench_cluster: interrupted; the cluster was torn down; partial results in {args.out}",
              file=sys.stderr)
        raise
    wall = time.perf_counter() - start
    run = {"command": " ".join(["python"] + sys.argv), "wall_s": wall, "batch": args.batch,
           "image_size": args.image_size, "steps": args.steps, "min_window_s": args.min_window, "rounds": args.rounds}
    with open(args.out, "a") as f:
        f.write(json.dumps({"run": run}) + "\n")
    report = format_report(*read_results(args.out))
    md = os.path.splitext(args.out)[0] + ".md"
    with open(md, "w") as f:
        f.write(report)
    print(report)
    print(f"results: {args.out}, tables: {md}; total {wall:.0f} s")


if __name__ == "__main__":
    main(parse_args())

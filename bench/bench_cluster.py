"""End-to-end DDP benchmark on a simulated, bandwidth-limited cluster on this machine (needs root, iproute2).

Run (from the repository root)::

    sudo python bench/bench_cluster.py --quick     # under 3 minutes
    sudo python bench/bench_cluster.py             # every configuration of issue 6, under 30 minutes
    sudo python bench/bench_cluster.py --nodes     # 2 nodes of 2 and of 4 hosts: hierarchical against flat

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
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(REPO, "recipes"))

from cluster import Cluster, ClusterError, check_prerequisites, exit_on_signals, parse_rate  # noqa: E402
from cluster_control import SAMPLE, ack_path, pending_request, write_atomic  # noqa: E402
from cluster_hosts import Hosts, start_hosts  # noqa: E402
from cluster_plan import BANDWIDTHS, Run, full_plan, headline_plan, nodes_plan, quick_plan, repeat  # noqa: E402
from cluster_plan import shared_topk_plan  # noqa: E402
from cluster_plan import summary_methods  # noqa: E402
from cluster_report import bandwidth_key, format_report, method_name, read_results  # noqa: E402
from nodes_report import format_nodes_report  # noqa: E402
from run_metrics import format_bytes  # noqa: E402

PORT = 29500  # inside host 0's namespace: nothing else listens there


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
            print(f"  {r['model']:<8} {r['hosts']} hosts {r['bandwidth']:>8}  {method_name(r):<42} "
                  f"{r['s_per_step']:7.3f} s/step  {format_bytes(r['wire_bytes_per_step']):>9} wire/step", flush=True)


def run_host_count(cluster: Cluster, hosts: int, runs: List[Run], args, port: int) -> None:
    """Start one worker per host for ``runs`` and answer their bandwidth requests until they finish."""
    folder = tempfile.mkdtemp(prefix="ddphb-ctl-")
    plan = {"runs": [{"model": r.model, "bandwidths": list(r.bandwidths), "round": r.round, "nodes": r.nodes,
                      "methods": [m.as_dict() for m in r.methods]} for r in runs],
            "steps": args.steps, "min_window_s": args.min_window, "batch": args.batch, "image_size": args.image_size,
            "timeout": args.timeout, "out": os.path.abspath(args.out)}
    write_atomic(os.path.join(folder, "plan.json"), json.dumps(plan))
    processes = start_hosts(cluster, hosts, [os.path.join(HERE, "cluster_worker.py"), folder], port, folder)
    progress, keep = _Progress(args.out), False
    try:
        _serve(cluster, processes, folder, progress)
    except RuntimeError:
        keep = True  # the hosts' logs
        raise
    finally:
        if not keep:
            shutil.rmtree(folder, ignore_errors=True)


def _serve(cluster: Cluster, processes: Hosts, folder: str, progress: "_Progress") -> None:
    """Apply the ranks' bandwidth requests until every host exits; RuntimeError when one fails."""
    seq, next_poll = 0, 0.0
    while True:
        rate = pending_request(folder, seq)
        if rate == SAMPLE:  # with nodes: what each node has sent to the others
            write_atomic(ack_path(folder, seq), json.dumps(cluster.uplink_bytes() if cluster.nodes > 1 else None))
            seq += 1
            continue
        if rate is not None:
            cluster.set_rate(rate)
            write_atomic(ack_path(folder, seq), "")
            seq += 1
            continue
        processes.check("the cluster benchmark")
        done = processes.all_done()
        if time.monotonic() > next_poll or done:
            progress.poll()
            next_poll = time.monotonic() + 0.5
        if done:
            return
        time.sleep(0.002)


# ----- command line -----
def build_plan(args) -> Dict[Tuple[int, int], List[Run]]:
    """The runs to measure, by (hosts, nodes) (one cluster and one launch of the hosts' processes each)."""
    if args.nodes:
        runs = nodes_plan()
    elif args.quick:
        runs = quick_plan()
    elif args.headline:
        runs = headline_plan()
    elif args.shared_topk:
        runs = shared_topk_plan()
    else:
        runs = full_plan(args.hosts, args.models, args.bandwidths, summary_methods() if args.summary_methods else None)
    runs = repeat(runs, args.rounds)
    plan: Dict[Tuple[int, int], List[Run]] = {}
    for run in runs:
        plan.setdefault((run.hosts, run.nodes), []).append(run)
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
    p.add_argument("--nodes", action="store_true",
                   help="dense inside nodes, sparse between them: resnet18 on 2 nodes of 2 hosts (100, 10, 5 and 2 "
                        "mbit between nodes) and of 4 hosts (1gbit), against the flat exchange")
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
    if args.quick + args.headline + args.shared_topk + args.nodes > 1:
        p.error("choose one of --quick, --headline, --shared-topk and --nodes")
    for name in ("quick", "headline", "shared_topk", "nodes"):
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
    args.bandwidths = sorted(set(args.bandwidths), key=bandwidth_key, reverse=True)
    if args.out is None:
        name = ("cluster-quick" if args.quick else "cluster-headline" if args.headline
                else "cluster-shared-topk" if args.shared_topk else "cluster-nodes" if args.nodes else "cluster")
        args.out = os.path.join(REPO, "bench", "results", name + ".jsonl")
    return args


def main(args) -> None:
    if args.report is not None:
        records, run = read_results(args.report)
        print((format_nodes_report if any(r.get("nodes", 1) > 1 for r in records) else format_report)(records, run))
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
        for i, ((hosts, nodes), runs) in enumerate(plan.items()):
            with Cluster(hosts, nodes=nodes) as cluster:
                print(f"{hosts} hosts{f' in {nodes} nodes' if nodes > 1 else ''}: "
                      f"{', '.join(r.model for r in runs)}", flush=True)
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
    report = (format_nodes_report if args.nodes else format_report)(*read_results(args.out))
    md = os.path.splitext(args.out)[0] + ".md"
    with open(md, "w") as f:
        f.write(report)
    print(report)
    print(f"results: {args.out}, tables: {md}; total {wall:.0f} s")


if __name__ == "__main__":
    main(parse_args())

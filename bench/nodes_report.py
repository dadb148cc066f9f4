"""The tables and targets of the hierarchical exchange on the simulated cluster (``bench_cluster.py --nodes``).

One table per (model, hosts, nodes, rate between nodes): each method's
seconds per step, its speed-up over the allreduce hook and over flat
random-block, the share of the step spent waiting for the exchange, what
each rank hands its collectives (payload) and what crossed between nodes
per host (the nodes' uplink counters). Then the targets: bytes on the slow
link at most ``1 / L`` of flat random-block's, at least 10x faster than the
allreduce hook at 100 Mbit/s, at least 1.3x faster than flat random-block
where its exchange is two thirds of its step or more.

    >>> rows = [{"hook": "sparsify", "method": "random_block", "ranks_per_node": 0, "s_per_step": 2.0}]
    >>> flat_row(rows, "random_block")["s_per_step"]
    2.0
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Dict, List, Optional, Sequence

from cluster_report import bandwidth_key, baseline, format_header, merge_rounds
from run_metrics import format_bytes

__all__ = ["format_nodes_report", "flat_row", "node_groups_of", "format_nodes_table", "format_nodes_targets",
           "exchange_share"]

SLOW_RATES_EXCHANGE_SHARE = 2 / 3  # where flat random-block's exchange is this share of its step or more


def node_groups_of(records: Sequence[dict]) -> "OrderedDict[tuple, List[dict]]":
    """Records by (model, hosts, nodes, bandwidth): hosts ascending, slowest rate first."""
    groups: "OrderedDict[tuple, List[dict]]" = OrderedDict()
    for r in sorted(records, key=lambda r: (r["model"], r["hosts"], r.get("nodes", 1), bandwidth_key(r["bandwidth"]))):
        groups.setdefault((r["model"], r["hosts"], r.get("nodes", 1), r["bandwidth"]), []).append(r)
    return groups


def flat_row(rows: Sequence[dict], method: str) -> Optional[dict]:
    """The flat (every rank with every other) row of the sparsifier ``method``, or None."""
    return next((r for r in rows if r["hook"] == "sparsify" and r["method"] == method
                 and not r.get("ranks_per_node", 0)), None)


def exchange_share(r: dict) -> float:
    """The part of the step in the hook or waiting for it after the backward pass: the sparsifier waits for its
    collectives inside its last bucket's call, so its exchange is counted in the hook's time."""
    return (r["compression_s"] + r["exchange_s"]) / r["s_per_step"]


def _hierarchical_rows(rows: Sequence[dict]) -> List[dict]:
    return [r for r in rows if r.get("ranks_per_node", 0)]


def format_nodes_table(rows: Sequence[dict]) -> str:
    base, flat = baseline(rows), flat_row(rows, "random_block")
    header = ("method", "s/step", "x allreduce", "x flat random-block", "exchange share", "payload/step/rank",
              "between nodes/step/host")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        seconds = f"{r['s_per_step']:.3f}"
        if r.get("rounds", 1) > 1:
            seconds += f" ({min(r['s_per_step_rounds']):.2f}-{max(r['s_per_step_rounds']):.2f})"
        slow = r.get("slow_link_bytes_per_step")
        lines.append("| " + " | ".join((
            r["label"], seconds, f"{base / r['s_per_step']:.2f}x" if base else "",
            f"{flat['s_per_step'] / r['s_per_step']:.2f}x" if flat else "",
            f"{exchange_share(r):.0%}", format_bytes(r["payload_bytes_per_step"]),
            "" if slow is None else format_bytes(slow))) + " |")
    return "\n".join(lines)


def format_nodes_targets(groups: Dict[tuple, List[dict]]) -> str:
    lines = ["### Targets", ""]
    for (model, hosts, nodes, bandwidth), rows in groups.items():
        where = f"{model}, {nodes} nodes x {hosts // nodes} hosts, {bandwidth}"
        base = baseline(rows)
        for r in _hierarchical_rows(rows):
            flat = flat_row(rows, r["method"])
            if flat is None:
                continue
            size = r["ranks_per_node"]
            slow, flat_slow = r.get("slow_link_bytes_per_step"), flat.get("slow_link_bytes_per_step")
            if slow is not None and flat_slow:
                verdict = "met" if slow <= flat_slow / size else "missed"
                lines.append(f"- {where}: {r['label']}: {format_bytes(slow)} between nodes per host and step, "
                             f"{slow / flat_slow:.2f} of flat's {format_bytes(flat_slow)} (target 1/{size}: "
                             f"{verdict}); payload per rank {r['payload_bytes_per_step'] / flat['payload_bytes_per_step']:.2f} "
                             "of flat's")
            if base and bandwidth == "100mbit":
                speedup = base / r["s_per_step"]
                lines.append(f"- {where}: {r['label']}: {speedup:.2f}x faster than the allreduce hook (target 10x: "
                             f"{'met' if speedup >= 10 else 'missed'})")
            share = exchange_share(flat)
            if bandwidth_key(bandwidth) < 100e6 and r["method"] == "random_block":
                speedup = flat["s_per_step"] / r["s_per_step"]
                rule = ("met" if speedup >= 1.3 else "missed") if share >= SLOW_RATES_EXCHANGE_SHARE else \
                    "not judged: flat's exchange is under two thirds of its step here"
                lines.append(f"- {where}: {r['label']}: {speedup:.2f}x faster than flat random-block, whose exchange "
                             f"is {share:.0%} of its step (target 1.3x: {rule})")
    return "\n".join(lines)


def format_nodes_report(records: Sequence[dict], run: Optional[dict]) -> str:
    header = format_header(run, records)
    groups = node_groups_of(merge_rounds(records))
    parts = [header, "", "Rates are those of each node's link to the others; inside a node the hosts share an "
             "unshaped bridge. \"between nodes\" is what the nodes' uplinks carried during the timed steps, per "
             "host; \"exchange share\" the part of the step spent in the hook (which waits for its collectives "
             "at the last bucket) or waiting for the exchange after the backward pass."]
    for (model, hosts, nodes, bandwidth), rows in groups.items():
        parts.append(f"\n### {model} ({rows[0]['params'] / 1e6:.2f} M parameters), {nodes} nodes x "
                     f"{hosts // nodes} hosts, {bandwidth} between nodes\n")
        parts.append(format_nodes_table(rows))
    parts.append("\n" + format_nodes_targets(groups))
    return "\n".join(parts) + "\n"

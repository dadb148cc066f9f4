"""Tables and plot of the time-to-accuracy benchmark: steps to the target times step time, per bandwidth.

A method's time to step ``S`` at a bandwidth is the sum of its step times
over steps ``0 .. S-1``, each step time measured on the simulated cluster at
that bandwidth: constant for most methods; the allreduce hook's for the dense
warm-up steps of PowerSGD and Local AdaAlter; for a sparsifier, its step time
at the density it sends at step ``s`` (the density warm-up), interpolated
linearly between the densities of the grid the cluster timed it at, each
side of the density where an AllGather selector turns to sending everything
by AllReduce apart (the hook's two paths cost differently).

    >>> interpolate([(1.0, 2.0), (0.1, 0.5), (0.01, 0.2)], 0.055)
    0.35
    >>> first_reaching([{"step": 10, "accuracy": 70.0}, {"step": 20, "accuracy": 80.0}], 75.0)["step"]
    20
"""

from __future__ import annotations

import json
import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ddp_hooks.sparsify.compressor import sends_everything

from cluster_report import merge_rounds, read_results
from cluster_plan import NOOP, Method
from bench_models import build_bench_model
from tta_plan import ADAGRAD_METHODS, BANDWIDTHS, HOSTS, MODEL, method_key, sparsify_options

__all__ = ["interpolate", "first_reaching", "StepTimes", "sparsify_options", "read_curves", "target_of", "report", "plot"]

TARGET_GAP = 1.0  # points below dense's final accuracy


def interpolate(points: Sequence[Tuple[float, float]], density: float) -> float:
    """The value at ``density`` of the piecewise-linear function through ``(density, value)`` points,
    held constant beyond the end points."""
    points = sorted(points)
    if density <= points[0][0]:
        return points[0][1]
    for (d0, v0), (d1, v1) in zip(points, points[1:]):
        if density <= d1:
            return v0 + (v1 - v0) * (density - d0) / (d1 - d0)
    return points[-1][1]


def first_reaching(curve: Sequence[dict], target: float) -> Optional[dict]:
    """The first evaluation at or above ``target``, or None."""
    return next((p for p in curve if p["accuracy"] >= target), None)


class StepTimes:
    """The cluster's step-time records (medians over rounds), looked up by bandwidth and method."""

    def __init__(self, records: Sequence[dict]):
        self.rows: Dict[Tuple[str, str], List[dict]] = {}
        for r in merge_rounds(records):
            self.rows.setdefault((r["bandwidth"], method_key(Method(**_method_fields(r)))), []).append(r)

    def record(self, bandwidth: str, method: Method) -> Optional[dict]:
        """The record of ``method`` as trained (a sparsifier at its own density)."""
        rows = self.rows.get((bandwidth, method_key(method)), [])
        if method.hook == "sparsify":
            rows = [r for r in rows if math.isclose(r["density"], method.density)]
        return rows[0] if rows else None

    def noop(self, bandwidth: str) -> Optional[float]:
        r = self.record(bandwidth, NOOP)
        return None if r is None else r["s_per_step"]

    def seconds(self, bandwidth: str, method: Method, steps: int) -> Optional[float]:
        """Seconds for the first ``steps`` steps of ``method`` at ``bandwidth`` (None if a timing is missing)."""
        rows = self.rows.get((bandwidth, method_key(method)), [])
        if not rows:
            return None
        if method.hook == "sparsify":
            options = sparsify_options(method)
            points = [(r["density"], r["s_per_step"]) for r in rows if r["density"] >= method.density - 1e-12]

            value_bytes = options.wire_dtype(torch.float32).itemsize  # (float32 gradients)

            def sends_all(density):  # the hook's path at this density (HOSTS ranks)
                return sends_everything(options, density, HOSTS, value_bytes, rows[0]["params"])

            by_path = {path: [p for p in points if sends_all(p[0]) == path] or points for path in (False, True)}
            return sum(interpolate(by_path[sends_all(d)], d) for d in map(options.density_at, range(steps)))
        dense = method.hook_warmup if method.hook in ("powersgd", "local_sgd") else 0
        allreduce = self.rows.get((bandwidth, "allreduce hook"))
        if dense and not allreduce:
            return None
        dense_s = allreduce[0]["s_per_step"] if dense else 0.0
        return min(dense, steps) * dense_s + max(steps - dense, 0) * rows[0]["s_per_step"]


def _method_fields(record: dict) -> dict:
    return {name: record.get(name) for name in Method.__dataclass_fields__ if name in record}


def read_curves(path: str) -> Tuple[dict, List[dict]]:
    with open(path) as f:
        header, *results = [json.loads(line) for line in f if line.strip()]
    return header, results


def target_of(results: Sequence[dict], label: str = "allreduce hook") -> float:
    """``label``'s final accuracy minus :data:`TARGET_GAP` points."""
    run = next((r for r in results if r["label"] == label), None)
    if run is None:
        raise ValueError(f"the curves hold no {label!r} run, whose final accuracy sets the target")
    return run["curve"][-1]["accuracy"] - TARGET_GAP


def _ms(seconds: float) -> str:
    return f"{1000 * seconds:.0f}"


def _method_table(results, times: StepTimes, bandwidth: str, target: float) -> List[str]:
    noop = times.noop(bandwidth)
    allreduce = next(r for r in results if r["label"] == "allreduce hook")
    base = _time_to(allreduce, times, bandwidth, target)
    dense_final = allreduce["curve"][-1]["accuracy"]
    lines = [f"#### {bandwidth}: target {target:.2f} % (the allreduce hook's final {dense_final:.2f} % minus "
             f"{TARGET_GAP:g} point)", "",
             "| method | s/step | x noop | forward / backward / exchange / compression, ms | epochs to target | "
             "time to target, s | speed-up over allreduce | final accuracy | payload to target per rank |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        method = Method(**r["method"])
        rec = times.record(bandwidth, method)
        if rec is None:
            lines.append(f"| {r['label']} | (not timed) |" + " |" * 7)
            continue
        split = " / ".join(_ms(rec[f"{p}_s"]) for p in ("forward", "backward", "exchange", "compression"))
        ratio = "" if noop is None else f"{rec['s_per_step'] / noop:.2f}"
        final = r["curve"][-1]["accuracy"]
        reached = first_reaching(r["curve"], target)
        if reached is None:
            cells = ["never", "never", "", f"{final:.2f} ({final - dense_final:+.2f})", ""]
        else:
            seconds = times.seconds(bandwidth, method, reached["step"])
            speedup = "" if base is None else f"{base / seconds:.2f}x"
            cells = [f"{reached['epoch']:.1f}", f"{seconds:.0f}", speedup,
                     f"{final:.2f} ({final - dense_final:+.2f})", f"{reached['payload_bytes'] / 1e6:.0f} MB"]
        lines.append(f"| {r['label']} | {rec['s_per_step']:.3f} | {ratio} | {split} | " + " | ".join(cells) + " |")
    return lines


def _time_to(run: dict, times: StepTimes, bandwidth: str, target: float) -> Optional[float]:
    reached = first_reaching(run["curve"], target)
    return None if reached is None else times.seconds(bandwidth, Method(**run["method"]), reached["step"])


def _warmup_lines(results, times: StepTimes, bandwidth: str) -> List[str]:
    """What the sparsifiers' default density warm-up costs: its steps' seconds against as many at the target."""
    lines = []
    for r in results:
        method = Method(**r["method"])
        rec = times.record(bandwidth, method)
        if method.hook != "sparsify" or rec is None or method.density_warmup is not None:
            continue
        steps = sparsify_options(method).density_warmup_steps
        warm = times.seconds(bandwidth, method, steps)
        lines.append(f"{r['label']} {warm:.0f} s (at its own density: {steps * rec['s_per_step']:.0f} s)")
    if not lines:
        return []
    return [f"The default density warm-up's {steps} steps at {bandwidth}: " + "; ".join(lines) + ".", ""]


def _adaalter_lines(results, times: StepTimes) -> List[str]:
    """Local AdaAlter against sync AdaGrad, to sync AdaGrad's own final accuracy minus 1 point."""
    sync = next((r for r in results if r["label"] == ADAGRAD_METHODS[0].label), None)
    if sync is None:
        return []
    target = target_of(results, sync["label"])
    lines = ["", f"Local AdaAlter against sync AdaGrad, to sync AdaGrad's final accuracy minus {TARGET_GAP:g} "
                 f"point ({target:.2f} %):", ""]
    for bandwidth in BANDWIDTHS:
        base = _time_to(sync, times, bandwidth, target)
        for r in results:
            if r["label"] in (m.label for m in ADAGRAD_METHODS[1:]):
                seconds = _time_to(r, times, bandwidth, target)
                text = "never" if seconds is None else (
                    f"{seconds:.0f} s, {base / seconds:.2f}x sync AdaGrad's {base:.0f} s" if base else f"{seconds:.0f} s")
                lines.append(f"- {bandwidth}: {r['label']}: {text}")
    return lines


def _wall_clock_lines(walls: Sequence[dict], times: StepTimes) -> List[str]:
    lines = ["", "Wall clock against the product (the method trained on the shaped cluster itself):", ""]
    for w in walls:
        last = w["curve"][-1]
        product = times.seconds(w["bandwidth"], Method(**w["method"]), last["step"])
        text = "not timed" if product is None else (
            f"{product:.0f} s by the product: measured / product = {last['train_s'] / product:.2f}")
        lines.append(f"- {w['bandwidth']}: {w['label']} reached {last['accuracy']:.2f} % at step {last['step']} in "
                     f"{last['train_s']:.0f} s of training (evaluations excluded); {text}")
    return lines


def _model_text(name: str) -> str:
    """``name (1.23 M parameters)``."""
    return f"{name} ({sum(p.numel() for p in build_bench_model(name).parameters()) / 1e6:.2f} M parameters)"


def report(curves_path: str, step_times_path: str, walls: Sequence[dict] = ()) -> str:
    """The markdown report of the three results files (``walls``: the wall-clock results)."""
    header, results = read_curves(curves_path)
    records, run = read_results(step_times_path)
    times = StepTimes(records)
    target = target_of(results)
    lines = [f"$ {header['command']}", f"$ {run['command'] if run else '(step times: no run line)'}", "",
             f"Fashion-MNIST, {_model_text(header.get('model', MODEL))}, {header['world']} ranks, "
             f"{header['train']} training images, {header['epochs']} epochs, evaluated every {header['eval_every']} steps on the 10,000 test "
             "images. Times to target are products: steps from the curves (loopback) times step times on the "
             "simulated cluster (4 hosts sharing this machine's cores).", ""]
    for bandwidth in BANDWIDTHS:
        noop = times.noop(bandwidth)
        lines += _method_table(results, times, bandwidth, target) + [""]
        if noop is not None:
            lines.append(f"Compute per step (the noop hook, no exchange) at {bandwidth}: {noop:.3f} s.")
            lines.append("")
        lines += _warmup_lines(results, times, bandwidth)
    lines += _adaalter_lines(results, times)
    if walls:
        lines += _wall_clock_lines(walls, times)
    return "\n".join(lines) + "\n"


def plot(curves_path: str, step_times_path: str, png_path: str) -> None:
    """Test accuracy against seconds (the product), one line per method, one panel per bandwidth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    _, results = read_curves(curves_path)
    times, target = StepTimes(read_results(step_times_path)[0]), target_of(results)
    fig, axes = plt.subplots(1, len(BANDWIDTHS), figsize=(7 * len(BANDWIDTHS), 5), sharey=True)
    for ax, bandwidth in zip(axes, BANDWIDTHS):
        for index, r in enumerate(results):
            method = Method(**r["method"])
            xs = [times.seconds(bandwidth, method, p["step"]) for p in r["curve"]]
            if None in xs:
                continue
            adagrad = method.optimizer in ("adagrad", "local_adaalter")  # the other family: dashed
            ax.plot(xs, [p["accuracy"] for p in r["curve"]], marker=".", label=r["label"],
                    color=plt.cm.tab20(index % 20), linestyle="--" if adagrad else "-")
        ax.axhline(target, color="grey", linestyle="--", linewidth=1, label="target")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_title(f"4 hosts, {bandwidth}")
        ax.set_xlabel("seconds of training (steps x measured step time)")
        ax.set_ylim(max(0.0, target - 25), None)
    axes[0].set_ylabel("test accuracy, %")
    axes[-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)

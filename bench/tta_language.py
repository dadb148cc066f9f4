"""Time to a validation perplexity on the simulated cluster: Local AdaAlter against sync AdaGrad, fortunes LSTM.

The seed paper's own kind of task (Xie et al. report up to 30 % less training
time on a language model). Curves: the committed 4-rank run of the Local
AdaAlter benchmark on Debian's ``fortunes`` files (``bench/results/
adaalter-fortunes-w4.jsonl``, the command on its first line): the
character-level LSTM (``bench_models``' ``fortunes-lstm``, 120,944
parameters), validation perplexity after each epoch of 96 steps per rank, 3
seeds, 32 synchronous warm-up steps before Local AdaAlter's local ones, at the
default lazy correction (``rate``). Step times: the cluster's worker on
``fortunes-lstm`` with 32 windows of 64 characters per host and step (4
hosts, 1 Gbit/s and 100 Mbit/s, ``--part lm-step-times``).

Local AdaAlter with a sparse synchronisation (pseudo-gradients and
accumulators through shared top-k, error-fed, no synchronous warm-up; at
0.05 every 8 steps, the sparse rows' lowest perplexity, and at 0.01 every 16
steps, over 500 times fewer bytes than sync AdaGrad): its curves are the
sparse rows' 4-rank run of the same benchmark
(``bench/results/adaalter-sparse-fortunes-w4.jsonl``), in a table of its own
against that run's sync AdaGrad (:func:`lm_report` of that file).

The target is sync AdaGrad's final perplexity (mean over the seeds). A
method's time to it: the warm-up steps at sync AdaGrad's step time, the rest
at its own, up to the end of the first epoch whose mean perplexity is at or
below the target.

    >>> first_epoch_at_or_below([13.4, 10.4, 9.4, 8.7], 9.5)
    3
    >>> first_epoch_at_or_below([13.4, 10.4], 9.5) is None
    True
"""

from __future__ import annotations

import json
import os
from typing import Dict, List, Optional, Sequence

from cluster_report import merge_rounds, read_results
from cluster_plan import ADAALTER, NOOP, SYNC_ADAGRAD, Method, Run, sparse_adaalter
from tta_plan import BANDWIDTHS, HOSTS

__all__ = ["LM_MODEL", "LM_CURVES", "LM_SPARSE_CURVES", "LM_RUNS", "warmup_of", "STEPS_PER_EPOCH", "WARMUP_STEPS", "lm_step_time_plan",
           "first_epoch_at_or_below", "mean_curves", "lm_report"]

LM_MODEL = "fortunes-lstm"
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
LM_CURVES = os.path.join(RESULTS, "adaalter-fortunes-w4.jsonl")
LM_SPARSE_CURVES = os.path.join(RESULTS, "adaalter-sparse-fortunes-w4.jsonl")
#: the cluster's method of each curve's run name
LM_RUNS: Dict[str, Method] = {"sync AdaGrad": SYNC_ADAGRAD, "LAA H=4 rate": ADAALTER[4], "LAA H=8 rate": ADAALTER[8],
                              "LAA H=8 rate w0 shared_topk d=0.05": sparse_adaalter(8, "shared_topk", 0.05),
                              "LAA H=16 rate w0 shared_topk d=0.01": sparse_adaalter(16, "shared_topk", 0.01)}
STEPS_PER_EPOCH = 96  # per rank, at 4 ranks (bench_adaalter_convergence: 384 steps per epoch over all ranks)
WARMUP_STEPS = 32  # synchronous steps before the local ones, in the curves' runs (none in a 'w0' run)


def warmup_of(name: str) -> int:
    """The synchronous steps of the curves' run ``name``: none for sync AdaGrad (all are) and 'w0' runs."""
    return 0 if name == "sync AdaGrad" or " w0" in name else WARMUP_STEPS


def lm_step_time_plan(rounds: int = 1) -> List[Run]:
    """The noop hook, sync AdaGrad, Local AdaAlter H = 4, 8 and the sparse rows of :data:`LM_RUNS` on
    ``fortunes-lstm``, :data:`HOSTS` hosts."""
    rows = [NOOP] + list(LM_RUNS.values())
    return [Run(HOSTS, LM_MODEL, rows, BANDWIDTHS, round=k) for k in range(rounds)]


def first_epoch_at_or_below(curve: Sequence[float], target: float) -> Optional[int]:
    """The first epoch (1-based) whose perplexity is at or below ``target``, or None."""
    return next((epoch for epoch, value in enumerate(curve, 1) if value <= target), None)


def mean_curves(path: str = LM_CURVES) -> Dict[str, List[float]]:
    """Each run name of :data:`LM_RUNS`: its perplexity after each epoch, the mean over the seeds in ``path``."""
    with open(path) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    curves: Dict[str, List[List[float]]] = {}
    for line in lines:
        if line.get("name") in LM_RUNS:
            curves.setdefault(line["name"], []).append(line["curve"])
    return {name: [sum(values) / len(values) for values in zip(*runs)] for name, runs in curves.items()}


def _step_seconds(records: Sequence[dict]) -> Dict[tuple, float]:
    return {(r["bandwidth"], r["label"]): r["s_per_step"] for r in merge_rounds(records)}


def lm_report(step_times_path: str, curves_path: str = LM_CURVES) -> List[str]:
    """Markdown lines: per bandwidth, each method of :data:`LM_RUNS` whose curve ``curves_path`` holds, its
    s/step, x noop, epochs and seconds to the target (sync AdaGrad's final perplexity in that file)."""
    curves = mean_curves(curves_path)
    records, run = read_results(step_times_path)
    seconds = _step_seconds(records)
    with open(curves_path) as f:
        curves_command = json.loads(f.readline())["command"]
    target = curves["sync AdaGrad"][-1]
    lines = [f"$ {curves_command}", f"$ {run['command'] if run else '(step times: no run line)'}", "",
             f"fortunes LSTM (120,944 parameters), 4 ranks, target: sync AdaGrad's final validation perplexity "
             f"{target:.3f} (mean of the seeds; perplexity after each epoch of {STEPS_PER_EPOCH} steps).", "",
             "| bandwidth | method | s/step | x noop | epochs to target | time to target, s | speed-up over "
             "sync AdaGrad | final perplexity |", "|---|---|---|---|---|---|---|---|"]
    for bandwidth in BANDWIDTHS:
        noop = seconds.get((bandwidth, NOOP.label))
        sync_s = seconds.get((bandwidth, SYNC_ADAGRAD.label))
        base = None
        for name, method in LM_RUNS.items():
            own = seconds.get((bandwidth, method.label))
            curve = curves.get(name)
            if curve is None:
                continue  # another file's run
            if own is None or sync_s is None:
                lines.append(f"| {bandwidth} | {method.label} | (not measured) |" + " |" * 5)
                continue
            epoch = first_epoch_at_or_below(curve, target)
            ratio = "" if noop is None else f"{own / noop:.2f}"
            if epoch is None:
                cells = ["never", "never", ""]
            else:
                steps = epoch * STEPS_PER_EPOCH
                warm = min(warmup_of(name), steps)
                total = warm * sync_s + (steps - warm) * own
                base = total if method is SYNC_ADAGRAD else base
                cells = [f"{epoch}", f"{total:.1f}", "" if base is None else f"{base / total:.2f}x"]
            lines.append(f"| {bandwidth} | {method.label} | {own:.3f} | {ratio} | " + " | ".join(cells)
                         + f" | {curve[-1]:.3f} |")
    return lines

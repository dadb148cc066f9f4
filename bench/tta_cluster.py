"""The time-to-accuracy benchmark's two parts on the simulated cluster (root): step times, and wall-clock runs.

* :func:`run_step_times`: the cluster benchmark's worker (``cluster_worker``,
  the same phase split) on a plan's model with 32 synthetic examples per host
  and step: every row of ``tta_plan.step_time_plan`` (``fmnist-cnn``) or of
  ``tta_language.lm_step_time_plan`` (``fortunes-lstm``) at 1 Gbit/s and
  100 Mbit/s; results as ``bench_cluster`` writes them (JSON lines, one
  ``{"run": ...}`` line last, and its markdown tables).
* :func:`run_wall_clock`: one method trained on the shaped cluster
  (``tta_training`` on every host) until it reaches the target, at one
  bandwidth; the result is the curve with ``train_s`` measured on the wire.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from typing import List

HERE = os.path.dirname(os.path.abspath(__file__))

from bench_cluster import PORT, run_host_count  # noqa: E402
from cluster import Cluster  # noqa: E402
from cluster_hosts import log_tail, start_hosts  # noqa: E402
from cluster_plan import Run  # noqa: E402
from cluster_report import format_report, read_results  # noqa: E402
from tta_plan import HOSTS  # noqa: E402
from tta_training import BATCH  # noqa: E402

__all__ = ["run_step_times", "run_wall_clock"]


def run_step_times(plan: List[Run], path: str, command: str, steps: int = 8, min_window_s: float = 3.0,
                   append: bool = False) -> None:
    """Time every row of ``plan`` on :data:`HOSTS` hosts; JSON lines to ``path`` (``append``: after those there,
    so a row measured in both runs gets the median of all their rounds), tables beside."""
    settings = argparse.Namespace(steps=steps, min_window=min_window_s, batch=BATCH, image_size=28, timeout=600.0,
                                  out=os.path.abspath(path))
    if not append:
        open(path, "w").close()
    start = time.perf_counter()
    with Cluster(HOSTS) as cluster:
        run_host_count(cluster, HOSTS, plan, settings, PORT)
    run = {"command": command, "wall_s": time.perf_counter() - start, "batch": BATCH, "image_size": 28,
           "steps": steps, "min_window_s": min_window_s, "rounds": len(plan), "model": plan[0].model}
    with open(path, "a") as f:
        f.write(json.dumps({"run": run}) + "\n")
    with open(os.path.splitext(path)[0] + ".md", "w") as f:
        f.write(format_report(*read_results(path)))


def run_wall_clock(spec: dict, bandwidth: str, timeout_s: float = 1800.0) -> dict:
    """Train ``spec`` (``tta_training.train_curve``'s) on :data:`HOSTS` shaped hosts; rank 0's result."""
    folder = tempfile.mkdtemp(prefix="ddphb-tta-")
    spec_path, out_path = os.path.join(folder, "spec.json"), os.path.join(folder, "out.json")
    with open(spec_path, "w") as f:
        json.dump(dict(spec, timeout=timeout_s), f)
    try:
        with Cluster(HOSTS) as cluster:
            cluster.set_rate(bandwidth)
            processes = start_hosts(cluster, HOSTS, [os.path.join(HERE, "tta_training.py"), spec_path, out_path],
                                    PORT, folder)
            deadline = time.monotonic() + timeout_s
            while not processes.all_done():
                processes.check(f"wall-clock run at {bandwidth}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"wall-clock run at {bandwidth}: timed out after {timeout_s:.0f} s; host 0's "
                                       f"log ends:\n{log_tail(processes.logs[0])}")
                time.sleep(0.2)
        with open(out_path) as f:
            result = json.load(f)
        result["bandwidth"] = bandwidth
        return result
    finally:
        shutil.rmtree(folder, ignore_errors=True)

"""Timing, the metrics file and the summary table of the CIFAR recipe.

The metrics file holds one JSON object per line, one line per epoch; see
:data:`TIME_FIELDS` for what each time measures. :func:`read_metrics` reads
it back (``plot.py`` uses it).
"""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from typing import Dict, Iterable, List

import torch

__all__ = ["TIME_FIELDS", "PhaseTimer", "MetricsFile", "read_metrics", "format_bytes", "summary_table"]

# What each time in the metrics file measures (rank 0, seconds per epoch).
TIME_FIELDS = {
    "time_data_s": "cutting, copying, augmenting and normalising the batches",
    "time_forward_s": "forward pass and loss",
    "time_backward_exchange_s": "backward pass, which includes DDP's gradient exchange: DDP calls the comm hook "
                                "from inside backward and waits for its futures before backward returns",
    "time_hook_call_s": "host time inside the comm hook function itself (selection, compression, launching the "
                        "collective; part of backward+exchange; on CUDA kernels run asynchronously, so this is "
                        "launch time, and waiting for the collective is not in it)",
    "time_optimizer_s": "optimizer step (for local_adaalter this includes its periodic averaging)",
    "time_eval_s": "test-set evaluation",
}


class PhaseTimer:
    """Sums wall time per phase; on CUDA it synchronises the device at each phase boundary."""

    def __init__(self, device: torch.device):
        self._cuda = device.type == "cuda"
        self.seconds: Dict[str, float] = {}

    def _sync(self) -> None:
        if self._cuda:
            torch.cuda.synchronize()

    @contextmanager
    def phase(self, name: str):
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def reset(self) -> None:
        self.seconds = {}


class MetricsFile:
    """Appends one JSON line per epoch to ``path``; on resume it first drops lines of epochs not yet done.

    A last line cut short (the run was killed while writing it) is dropped too.
    """

    def __init__(self, path: str, resume_epoch: int = 0):
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        kept = [r for r in read_metrics(path, torn_tail_ok=True) if r["epoch"] <= resume_epoch] if (
            resume_epoch and os.path.exists(path)) else []
        with open(path, "w") as f:
            for record in kept:
                f.write(json.dumps(record) + "\n")
        self.records: List[dict] = kept

    def write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        self.records.append(record)


def read_metrics(path: str, torn_tail_ok: bool = False) -> List[dict]:
    """The records of a metrics file, in order; with ``torn_tail_ok``, an unreadable last line is skipped."""
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if not (torn_tail_ok and i == len(lines) - 1):
                raise
    return records


def format_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 kB'`` (powers of 1000)."""
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"  # pragma: no cover


def summary_table(records: Iterable[dict]) -> str:
    """A text table of the per-epoch records: accuracy, losses, throughput, bytes."""
    header = ("epoch", "train loss", "test loss", "test acc", "img/s", "sent/step", "dense/sent", "fwd s",
              "bwd+exch s", "hook s", "opt s")
    rows = [header]
    for r in records:
        ratio = r["bytes_dense"] / r["bytes_sent"] if r["bytes_sent"] else float("inf")
        rows.append((str(r["epoch"]), f"{r['train_loss']:.3f}", f"{r['test_loss']:.3f}",
                     f"{100 * r['test_accuracy']:.1f}%", f"{r['images_per_s']:.0f}",
                     format_bytes(r["bytes_sent_per_step"]), f"{ratio:.1f}x",
                     f"{r['time_forward_s']:.2f}", f"{r['time_backward_exchange_s']:.2f}",
                     f"{r['time_hook_call_s']:.2f}", f"{r['time_optimizer_s']:.2f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [" | ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)

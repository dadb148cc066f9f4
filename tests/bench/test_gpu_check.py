"""bench/gpu_check.py --dry-run: the one-GPU check's own code paths on the CPU (gloo, tiny sizes, seconds).

The script is what a lent GPU machine runs, once, in a few minutes of device time: a broken script wastes
them. Its dry run goes through the same configurations, counting wrappers, bitwise comparison (against a
second CPU run in a child process) and timing table, and skips only what needs CUDA.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

from paths import BENCH, ROOT

CPU_CHECKS = ("collectives", "bitwise", "timing")
CUDA_CHECKS = ("sync", "sanitizer")


def test_dry_run_passes_what_the_cpu_can_check_and_skips_the_rest():
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "gpu_check.py"), "--dry-run"], cwd=ROOT,
                          capture_output=True, text=True, timeout=240)
    _, _, tail = proc.stdout.partition("\n== summary")
    summary = {check: (status, detail) for check, status, detail in
               re.findall(r"^(\w+) +(PASS|FAIL|SKIPPED) +(.*)$", tail, re.M)}
    assert set(summary) == set(CPU_CHECKS + CUDA_CHECKS), proc.stdout[-3000:] + proc.stderr[-3000:]
    for check in CPU_CHECKS:  # at world size 1, so the collectives check needs a hook that never skips them
        assert summary[check][0] == "PASS", (summary[check], proc.stdout[-3000:])
    for check in CUDA_CHECKS:
        assert summary[check] == ("SKIPPED", "needs CUDA (dry run)")
    assert re.search(r"^\| shared_topk d=0\.01 \| [\d.]+ \| [\d.]+ \|$", proc.stdout, re.M)  # the timing table
    assert proc.returncode == 0, proc.stderr[-3000:]

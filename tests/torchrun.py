"""Run a script under torchrun on this machine, as a user would, for the tests of the README's examples.

Gloo's teardown aborts a worker now and then after its work is done
(``terminate called without an active exception`` from a thread destroyed
at exit, then SIGABRT). The test harness's own children avoid it by leaving
through ``os._exit`` (:mod:`ddp_hooks.testing`); a user's script cannot.
So a run that ends in exactly that abort is run once more from a clean
folder, and the second run's result is what the test checks: a real failure
fails both times.
"""

import shutil
import subprocess
import sys

from ddp_hooks.testing import free_port

__all__ = ["run_under_torchrun", "TEARDOWN_ABORT"]

TEARDOWN_ABORT = "terminate called without an active exception"


def run_under_torchrun(script, cwd, timeout, nproc=2):
    """``subprocess.run`` of ``script`` under torchrun with ``nproc`` workers in ``cwd`` (text output captured)."""
    proc = _run(script, cwd, timeout, nproc)
    if proc.returncode != 0 and TEARDOWN_ABORT in proc.stderr:
        for entry in cwd.iterdir():  # what the aborted run wrote must not count for the second one
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        proc = _run(script, cwd, timeout, nproc)
    return proc


def _run(script, cwd, timeout, nproc):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={nproc}",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", script]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd)

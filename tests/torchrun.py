"""Run a script under torchrun on this machine, as a user would, for the tests of the README's examples.

Gloo's teardown aborts a worker now and then after its work is done
(``terminate called without an active exception`` from a thread destroyed
at exit, then SIGABRT). The test harness's own children avoid it by leaving
through ``os._exit`` (:mod:`ddp_hooks.testing`); a user's script cannot.
So a run that ends in exactly that abort is run again from a clean folder,
up to ``ATTEMPTS`` runs in all, and the last run's result is what the test
checks: a real failure fails every time. (Measured on 2026-12-07: 2 and 3 of
15 runs of ``recipes/accelerate_quickstart.py`` ended in that abort, with and
without ``accelerator.end_training()``; a fresh-clone CI run failed on two
in a row.)
"""

import shutil
import subprocess
import sys

from ddp_hooks.testing import free_port

__all__ = ["run_under_torchrun", "TEARDOWN_ABORT"]

TEARDOWN_ABORT = "terminate called without an active exception"
ATTEMPTS = 4  # at the rate measured above, four aborts in a row: about 1 in 1000


def run_under_torchrun(script, cwd, timeout, nproc=2, args=()):
    """``subprocess.run`` of ``script args`` under torchrun with ``nproc`` workers in ``cwd`` (text output captured)."""
    proc = _run(script, cwd, timeout, nproc, args)
    for _ in range(ATTEMPTS - 1):
        if proc.returncode == 0 or TEARDOWN_ABORT not in proc.stderr:
            break
        for entry in cwd.iterdir():  # what the aborted run wrote must not count for the next one
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        proc = _run(script, cwd, timeout, nproc, args)
    return proc


def _run(script, cwd, timeout, nproc, args=()):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={nproc}",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", script, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd)

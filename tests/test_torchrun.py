"""tests/torchrun.py: a run that ends in gloo's teardown abort is run again, up to ATTEMPTS runs; any other failure
is not."""

import os
import textwrap

from torchrun import ATTEMPTS, TEARDOWN_ABORT, run_under_torchrun

SCRIPT = """
import os, sys
runs = os.environ["RUNS_FILE"]
if os.environ["RANK"] == "0":
    with open(runs, "a") as f:
        f.write("run\\n")
    open("written-by-the-run", "w").close()
    n = len(open(runs).read().split())
    if os.environ["MODE"].startswith("abort-") and n <= int(os.environ["MODE"][6:]):
        sys.stderr.write("{abort}\\n"); sys.stderr.flush()
        os.abort()
    if os.environ["MODE"] == "fail":
        raise ValueError("a real failure")
print("done")
"""


def _run(tmp_path, mode):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(SCRIPT.format(abort=TEARDOWN_ABORT)))
    work = tmp_path / "work"
    work.mkdir()
    runs = tmp_path / "runs"
    os.environ.update(RUNS_FILE=str(runs), MODE=mode)
    try:
        proc = run_under_torchrun(str(script), work, timeout=120)
    finally:
        del os.environ["RUNS_FILE"], os.environ["MODE"]
    return proc, len(runs.read_text().split()), sorted(os.listdir(work))


def test_a_teardown_abort_is_run_again_and_the_next_run_decides(tmp_path):
    proc, runs, left = _run(tmp_path, "abort-2")
    assert proc.returncode == 0 and "done" in proc.stdout and runs == 3
    assert left == ["written-by-the-run"]  # the last run's file, in a folder cleared between the runs


def test_aborts_in_every_attempt_fail(tmp_path):
    proc, runs, _ = _run(tmp_path, f"abort-{ATTEMPTS}")
    assert proc.returncode != 0 and TEARDOWN_ABORT in proc.stderr and runs == ATTEMPTS


def test_any_other_failure_fails_at_once(tmp_path):
    proc, runs, _ = _run(tmp_path, "fail")
    assert proc.returncode != 0 and "a real failure" in proc.stderr and runs == 1

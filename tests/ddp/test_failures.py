"""Failures: a rank that dies or stalls mid-step, and a recipe run killed mid-epoch.

The survivors must end with an error within the collective timeout, never
hang; a killed recipe run must resume from its last checkpoint to the
parameters of an uninterrupted run (bitwise on CPU).
"""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_hooks import SparsifyState, sparsify_hook
from ddp_hooks.testing import ChildFailedError, free_port, run_distributed
from small_mlp import batch, small_mlp
from paths import RECIPES  # noqa: E402

COLLECTIVE_TIMEOUT = 6.0
FAIL_STEP = 2


def _train_until_rank1_fails(rank, world_size, how, mark):
    """Rank 1 dies (os._exit) or stalls (sleeps) in the hook of bucket 1 at step 2, after bucket 0 was exchanged."""
    model = DDP(small_mlp(), bucket_cap_mb=0.002)
    state = SparsifyState(method="topk", aggregation="allgather", density=0.1)

    def hook(st, bucket):
        if rank == 1 and st.step == FAIL_STEP and bucket.index() == 1:
            with open(mark, "w") as f:
                f.write(repr(time.time()))
            if how == "dies":
                os._exit(7)
            time.sleep(10 * COLLECTIVE_TIMEOUT)
        return sparsify_hook(st, bucket)

    model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(5):
        opt.zero_grad()
        model(batch(rank, step)).pow(2).mean().backward()
        opt.step()


def test_rank_dying_mid_step_ends_the_others_with_an_error(tmp_path):
    mark = str(tmp_path / "died_at")
    with pytest.raises(ChildFailedError, match="rank 1: exited with code 7") as info:
        run_distributed(_train_until_rank1_fails, 2, "dies", mark, timeout=120,
                        collective_timeout=COLLECTIVE_TIMEOUT, grace=COLLECTIVE_TIMEOUT + 20)
    survivor = info.value.reports[0]
    assert survivor is not None and not survivor["ok"], survivor  # rank 0 raised; it was not killed while hanging
    assert "peer" in survivor["message"], survivor  # gloo's "Connection reset/closed by peer", from backward
    with open(mark) as f:
        died_at = float(f.read())
    assert survivor["failed_at"] - died_at < COLLECTIVE_TIMEOUT + 5, survivor


def test_stalled_rank_ends_the_others_at_the_collective_timeout(tmp_path):
    mark = str(tmp_path / "stalled_at")
    with pytest.raises(RuntimeError) as info:
        run_distributed(_train_until_rank1_fails, 2, "stalls", mark, timeout=120,
                        collective_timeout=COLLECTIVE_TIMEOUT, grace=2.0)
    done = time.time()
    assert "timed out" in str(info.value).lower(), str(info.value)[:500]
    with open(mark) as f:
        stalled_at = float(f.read())
    assert COLLECTIVE_TIMEOUT - 1 < done - stalled_at < COLLECTIVE_TIMEOUT + 15


RECIPE = os.path.join(RECIPES, "train_cifar.py")
RUN = ["--model", "resnet20", "--width", "4", "--image-size", "8", "--synthetic-size", "256", "--batch-size", "8",
       "--threads", "1", "--lr", "0.05", "--epochs", "2", "--log-every", "2", "--hook", "sparsify",
       "--method", "random_block", "--density", "0.1"]


def _torchrun(*extra):
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", RECIPE, *RUN, *extra]


def _process_tree(pid):
    """``pid`` and its descendants, from /proc: torchrun starts each worker in a session of its own,
    so killing torchrun's process group would leave the workers training on."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    children.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(entry))
            except (OSError, IndexError, ValueError):  # the process ended while we read
                continue
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo.extend(children.get(tree[-1], []))
    return tree


def _kill_job(pid):
    for p in reversed(_process_tree(pid)):  # the workers first, so none of them writes another file
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _final(out_dir):
    return [torch.load(os.path.join(out_dir, f"checkpoint-rank{r}.pt"), weights_only=True) for r in (0, 1)]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds torchrun's workers through /proc")
def test_recipe_killed_mid_epoch_resumes_to_the_uninterrupted_parameters(tmp_path):
    straight, broken = str(tmp_path / "straight"), str(tmp_path / "broken")
    done = subprocess.run(_torchrun("--out-dir", straight), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]

    # The whole job (torchrun and both ranks) is killed once epoch 2 is under way.
    proc = subprocess.Popen(_torchrun("--out-dir", broken), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    try:
        for line in proc.stderr:
            if "epoch 2 step 2/" in line:
                break
    finally:
        _kill_job(proc.pid)
        proc.wait(timeout=60)
    assert [snap["epoch"] for snap in _final(broken)] == [1, 1], "the kill must land mid-epoch 2"
    time.sleep(1.0)
    assert [snap["epoch"] for snap in _final(broken)] == [1, 1], "no worker may survive the kill"

    resumed = subprocess.run(_torchrun("--out-dir", broken, "--resume"), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "at epoch 1" in resumed.stderr
    for want, got in zip(_final(straight), _final(broken)):
        assert got["epoch"] == want["epoch"] == 2 and got["step"] == want["step"]
        for name, tensor in want["model"].items():
            assert torch.equal(tensor, got["model"][name]), name

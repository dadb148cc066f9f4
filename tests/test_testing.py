"""The harness must report failures: a harness that swallows them makes every test pass."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from ddp_hooks.testing import ChildFailedError, RemoteTraceback, assert_replicas_equal, run_distributed


def _allreduce_rank(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return (rank, dist.get_world_size(), t.item())


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_runs_every_rank_and_returns_in_rank_order(world_size):
    out = run_distributed(_allreduce_rank, world_size)
    total = float(sum(range(world_size)))
    assert out == [(r, world_size, total) for r in range(world_size)]


def _fail_on_rank(rank, world_size, bad_rank):
    if rank == bad_rank:
        raise ValueError(f"boom on rank {rank}")
    dist.barrier()  # the healthy ranks block here, waiting for the failed one
    return rank


def test_child_exception_is_reraised_with_its_traceback():
    with pytest.raises(ValueError, match="boom on rank 1") as info:
        run_distributed(_fail_on_rank, 3, 1, timeout=60)
    cause = info.value.__cause__
    assert isinstance(cause, RemoteTraceback)
    assert cause.rank == 1
    assert "_fail_on_rank" in cause.text


def test_failed_assertion_in_child_fails_the_test():
    with pytest.raises(AssertionError):
        run_distributed(_assert_false, 2)


def _assert_false(rank, world_size):
    assert rank == -1, "child assertion"


def _hard_exit(rank, world_size):
    if rank == 0:
        os._exit(3)
    return rank


def test_child_that_dies_without_reporting_is_a_failure():
    with pytest.raises(ChildFailedError, match="exited with code 3"):
        run_distributed(_hard_exit, 2, timeout=60)


def _die_while_peer_sleeps(rank, world_size):
    if rank == 0:
        os._exit(5)
    time.sleep(600)


def test_dead_rank_is_reported_and_a_hung_peer_is_killed_after_the_grace_period():
    start = time.monotonic()
    with pytest.raises(ChildFailedError, match="rank 0: exited with code 5") as info:
        run_distributed(_die_while_peer_sleeps, 2, timeout=120, grace=1.0)
    # rank 1 never reported: it was still running and was killed, not mistaken for a success
    assert info.value.reports == {0: None, 1: None}
    assert time.monotonic() - start < 60


def _hang(rank, world_size):
    time.sleep(600)


def test_hung_child_is_killed_at_the_timeout():
    import multiprocessing

    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] of 2 still running"):
        run_distributed(_hang, 2, timeout=8)
    assert time.monotonic() - start < 60
    # nothing left behind: no live child processes of this test process
    assert multiprocessing.active_children() == []


def _unpicklable_exception(rank, world_size):
    class Local(Exception):  # defined locally: cannot be pickled back
        pass

    raise Local("local failure")


def test_unpicklable_exception_becomes_child_failed_error():
    with pytest.raises(ChildFailedError, match="Local: local failure"):
        run_distributed(_unpicklable_exception, 1)


def _replicas(rank, world_size, perturb):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    if perturb and rank == world_size - 1:
        with torch.no_grad():
            model.bias[0] += 1e-3
    assert_replicas_equal(model)
    return True


def test_assert_replicas_equal_passes_on_equal_models():
    assert run_distributed(_replicas, 3, False) == [True] * 3


def test_assert_replicas_equal_names_the_differing_tensor():
    with pytest.raises(AssertionError, match="'bias' on rank 2 differs"):
        run_distributed(_replicas, 3, True)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_world_size_is_validated(bad):
    with pytest.raises(ValueError, match="`world_size` must be an int >= 1"):
        run_distributed(_allreduce_rank, bad)
    with pytest.raises(ValueError, match="`grace` must be a positive number of seconds"):
        run_distributed(_allreduce_rank, 1, grace=bad if bad != 1.5 else -1.5)


def _environment_and_state(rank, world_size, name):
    return os.environ.get(name), dist.is_initialized(), torch.distributed.get_world_size()


def test_children_get_the_environment_of_the_call_and_a_fresh_process_group():
    """Children start from a process made before this call (a forkserver): they still see the environment as it
    is at the call, and join their own group."""
    run_distributed(_allreduce_rank, 2)  # the forkserver (if any) is running from here on
    name = "DDP_HOOKS_TEST_VARIABLE"
    for value in ("one", "two"):
        os.environ[name] = value
        try:
            assert run_distributed(_environment_and_state, 2, name) == [(value, True, 2)] * 2
        finally:
            del os.environ[name]
    assert run_distributed(_environment_and_state, 2, name) == [(None, True, 2)] * 2


_joined_at = None  # in a child: when init_process_group returned there (set by _install_slow_join)


def _install_slow_join(rank, seconds):
    """In a child: ``rank`` returns from ``init_process_group`` ``seconds`` late, as a rank short of CPU does."""
    join = dist.init_process_group

    def slow_join(*args, **kwargs):
        global _joined_at
        join(*args, **kwargs)
        if dist.get_rank() == rank:
            time.sleep(seconds)
        _joined_at = time.time()

    dist.init_process_group = slow_join


class _SlowJoin:
    """An argument of ``fn`` that, unpickled in a child before it joins, makes one rank slow to join."""

    def __init__(self, rank, seconds):
        self.rank, self.seconds = rank, seconds

    def __reduce__(self):
        return _install_slow_join, (self.rank, self.seconds)


def _joined_and_started(rank, world_size, _):
    return _joined_at, time.time()


def test_no_rank_starts_before_every_rank_has_joined():
    """A rank whose ``fn`` returns at once must not leave while a peer is still joining: the peer then failed in
    gloo's rendezvous ("Gloo connectFullMesh failed ... Connection closed by peer"; 44 of 600 calls like those of
    the test above, on 2 busy cores)."""
    out = run_distributed(_joined_and_started, 2, _SlowJoin(rank=1, seconds=1.0), timeout=60)
    joined = [j for j, _ in out]
    assert None not in joined, "the children did not join through the slowed init_process_group"
    assert [started >= max(joined) for _, started in out] == [True, True], out

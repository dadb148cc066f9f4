"""Run a function on several CPU processes in a gloo group (:func:`run_distributed`); see :mod:`ddp_hooks.testing`."""

from __future__ import annotations

import os
import pickle
import shutil
import socket
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, List, Optional

__all__ = ["ChildFailedError", "RemoteTraceback", "run_distributed", "free_port"]


class ChildFailedError(RuntimeError):
    """A child process failed without an exception that could be re-raised.

    ``reports`` maps every rank to what it reported before the run ended:
    ``None`` (nothing: it died silently, or was still running and was
    killed), or a dict with ``ok`` and, for a failure, ``type``, ``message``
    and ``failed_at`` (``time.time()`` when it raised). Tests of failure
    handling read it to see how the *other* ranks ended.
    """

    def __init__(self, rank: int, message: str, reports: Optional[dict] = None):
        super().__init__(f"rank {rank}: {message}")
        self.rank = rank
        self.reports = reports or {}


class RemoteTraceback(Exception):
    """Carries a child's formatted traceback; set as ``__cause__`` of the re-raised error."""

    def __init__(self, rank: int, text: str):
        super().__init__(f"traceback of rank {rank}:\n{text}")
        self.rank = rank
        self.text = text

    def __str__(self) -> str:
        return self.args[0]


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago (for torchrun or TCP stores)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_atomic(path: str, payload: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        pickle.dump(payload, f)
    os.replace(tmp, path)


def _wait_for_every_rank(path, rank, world_size, timeout):
    """Return once every rank has returned from ``init_process_group``.

    ``init_process_group`` ends on each rank on its own (no barrier unless
    ``TORCH_DIST_INIT_BARRIER=1``): without this wait, a rank whose ``fn``
    returns at once leaves, closing its sockets, while a slower peer is still
    in gloo's rendezvous, which then fails with "Gloo connectFullMesh failed
    ... Connection closed by peer".
    """
    import torch.distributed as dist

    store = dist.FileStore(path, world_size)
    store.set(f"rank{rank}", "joined")
    store.wait([f"rank{r}" for r in range(world_size)], timedelta(seconds=timeout))


def _child_main(fn, rank, world_size, store_path, result_dir, backend, timeout, environ, args, kwargs):
    # The parent's environment as it is now (a forkserver's child inherits the server's, from its start)
    os.environ.clear()
    os.environ.update(environ)
    import torch
    import torch.distributed as dist

    # Several ranks share few cores: one intra-op thread each avoids
    # oversubscription that makes a 4-rank test on 2 cores crawl.
    torch.set_num_threads(1)
    result_path = os.path.join(result_dir, f"rank{rank}.pkl")
    exit_code = 0
    try:
        dist.init_process_group(
            backend,
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout),
        )
        _wait_for_every_rank(os.path.join(result_dir, "joined"), rank, world_size, timeout)
        value = fn(rank, world_size, *args, **kwargs)
        payload = {"ok": True, "value": value}
        try:
            pickle.dumps(payload)
        except Exception as exc:  # the function's return value must travel back
            raise TypeError(
                f"run_distributed: the return value of {getattr(fn, '__name__', fn)!r} on rank {rank} "
                f"cannot be pickled ({exc}); return plain Python values or CPU tensors"
            ) from exc
        _write_atomic(result_path, payload)
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
        failed_at = time.time()
        exit_code = 1
        text = traceback.format_exc()
        try:
            blob = pickle.dumps(exc)
            pickle.loads(blob)
        except Exception:
            blob = None
        _write_atomic(result_path, {"ok": False, "exc": blob, "type": type(exc).__name__,
                                    "message": str(exc), "traceback": text,
                                    "failed_at": failed_at})
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except BaseException:
            pass
        os._exit(exit_code)


def _read_result(result_dir: str, rank: int) -> Optional[dict]:
    path = os.path.join(result_dir, f"rank{rank}.pkl")
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return pickle.load(f)


def _raise_child_error(rank: int, res: dict):
    remote = RemoteTraceback(rank, res["traceback"])
    exc = pickle.loads(res["exc"]) if res["exc"] is not None else None
    if exc is None:
        exc = ChildFailedError(rank, f"{res['type']}: {res['message']}")
    raise exc from remote


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    backend: str = "gloo",
    collective_timeout: Optional[float] = None,
    grace: float = 2.0,
    **kwargs: Any,
) -> List[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` processes.

    Each process joins a fresh process group (``backend``, default gloo on
    CPU), waits until every rank has joined, runs ``fn`` and leaves the group.

    Args:
        fn: a module-level (picklable) function.
        world_size (int): number of processes, >= 1.
        *args, **kwargs: passed to ``fn``; must be picklable.
        timeout (float): seconds for the whole run, also used as the process
            group's collective timeout unless ``collective_timeout`` is given.
        backend (str): ``torch.distributed`` backend.
        collective_timeout (float): the process group's timeout, in seconds.
        grace (float): once a rank has failed, seconds the others get to
            report before they are killed (a test of failure handling gives
            them the collective timeout and more).

    Returns:
        The list of the ranks' return values, indexed by rank.

    Raises:
        The first failing rank's own exception (its traceback as ``__cause__``),
        :class:`ChildFailedError` for a child that died without reporting, and
        ``TimeoutError`` when ranks were still running at the deadline (they
        are killed first).

    Example::

        >>> from ddp_hooks.testing import run_distributed
        >>> run_distributed(_doctest_rank_times_ten, world_size=2)
        [0, 10]
    """
    import multiprocessing

    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"`world_size` must be an int >= 1, got {world_size!r}")
    for name, value in (("timeout", timeout), ("collective_timeout", collective_timeout), ("grace", grace)):
        if value is None and name == "collective_timeout":
            continue
        if isinstance(value, bool) or not (isinstance(value, (int, float)) and value > 0):
            raise ValueError(f"`{name}` must be a positive number of seconds, got {value!r}")
    ctx = _context(multiprocessing)
    workdir = tempfile.mkdtemp(prefix="ddp_hooks_run_")
    store_path = os.path.join(workdir, "store")
    procs = []
    try:
        for rank in range(world_size):
            p = ctx.Process(
                target=_child_main,
                args=(fn, rank, world_size, store_path, workdir, backend, collective_timeout or timeout,
                      dict(os.environ), args, kwargs),
                daemon=True,
            )
            p.start()
            procs.append(p)
        deadline = time.monotonic() + timeout
        failed_rank = None
        while True:
            alive = [r for r, p in enumerate(procs) if p.is_alive()]
            # A rank that reported an error ends the run: the others may be
            # blocked forever in a collective waiting for it.
            for r, p in enumerate(procs):
                if not p.is_alive():
                    res = _read_result(workdir, r)
                    if res is None or not res["ok"]:
                        failed_rank = r
                        break
            if failed_rank is not None or not alive:
                break
            if time.monotonic() > deadline:
                for r in alive:
                    procs[r].kill()
                for p in procs:
                    p.join()
                raise TimeoutError(
                    f"run_distributed: ranks {alive} of {world_size} still running after "
                    f"{timeout:g} s; they were killed"
                )
            procs[alive[0]].join(0.05)
        if failed_rank is not None:
            # Give the others a moment to report their own errors, then stop them.
            until = time.monotonic() + grace
            for p in procs:
                p.join(max(0.0, until - time.monotonic()))
            killed = set()
            for r, p in enumerate(procs):
                if p.is_alive():
                    p.kill()
                    killed.add(r)
                p.join()
            reports = {r: _read_result(workdir, r) for r in range(world_size)}
            silent = [r for r in range(world_size) if reports[r] is None and r not in killed]
            if silent:  # a rank that died without a word is the likely cause of the others' errors
                r = silent[0]
                raise ChildFailedError(
                    r, f"exited with code {procs[r].exitcode} without reporting a result",
                    {q: None if rep is None else {k: rep.get(k) for k in ("ok", "type", "message", "failed_at")}
                     for q, rep in reports.items()},
                )
            # Else report the rank that failed first: the others usually fail
            # because it left (gloo's "Connection closed by peer").
            errors = {r: res for r, res in reports.items() if res is not None and not res["ok"]}
            first = min(errors, key=lambda r: errors[r]["failed_at"])
            _raise_child_error(first, errors[first])
        results = []
        for r, p in enumerate(procs):
            p.join()
            res = _read_result(workdir, r)
            if res is None:  # pragma: no cover - covered by the loop above
                raise ChildFailedError(r, f"exited with code {p.exitcode} without reporting a result")
            results.append(res["value"])
        return results
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        shutil.rmtree(workdir, ignore_errors=True)


def _context(multiprocessing):
    """A forkserver that imported torch once, where the platform has one, else ``spawn``.

    Either way a child starts from a process that never ran torch code nor
    joined a process group; the forkserver spares each child the import of
    torch (seconds each, and the package's tests start hundreds of children).
    """
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])  # read once, when the server starts
    return ctx


def _doctest_rank_times_ten(rank: int, world_size: int) -> int:
    return rank * 10

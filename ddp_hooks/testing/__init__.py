"""Run a function on several CPU processes in a gloo group, and compare replicas.

This is the harness behind the package's own multi-process tests, public so
that downstream code can test its hooks the same way::

    from ddp_hooks.testing import run_distributed

    def body(rank, world_size):
        import torch, torch.distributed as dist
        t = torch.tensor([float(rank)])
        dist.all_reduce(t)
        return t.item()

    assert run_distributed(body, world_size=2) == [1.0, 1.0]

Design (each point is a trap some harness fell into):

* Children start from a forkserver that has imported torch and done nothing
  else (``spawn`` where there is no forkserver), so they never inherit a
  half-initialised torch or process group from the parent, and do not each
  spend seconds importing torch; each gets the parent's environment as it
  is at the call.
* The rendezvous is a ``FileStore`` in a fresh temporary folder: no port to
  collide with a concurrent test run.
* No rank runs the function before every rank has joined the group:
  ``init_process_group`` has no barrier of its own, and a rank whose
  function returned at once used to leave, closing its sockets, while a
  slower peer was still in gloo's rendezvous ("Gloo connectFullMesh failed
  ... Connection closed by peer").
* Children are joined against one deadline; when it passes, every live child
  is killed and joined (no zombies) and ``TimeoutError`` names them.
* A child's exception is pickled back and re-raised in the parent with the
  child's traceback attached as its ``__cause__``; a child that dies without
  reporting (a crash, ``os._exit``) raises :class:`ChildFailedError`.  A
  harness that only checks exit codes, or swallows failures, makes every
  test pass: ``tests/test_testing.py`` checks that this one does not.
* A child that returned its result leaves through ``os._exit`` right after
  ``destroy_process_group``: gloo's teardown aborts now and then at
  interpreter exit ("terminate called without an active exception") even in
  plain DDP, and that must not be reported as a test failure.
"""

from .processes import ChildFailedError, RemoteTraceback, free_port, run_distributed
from .replicas import assert_replicas_equal

__all__ = ["ChildFailedError", "RemoteTraceback", "run_distributed", "assert_replicas_equal", "free_port"]

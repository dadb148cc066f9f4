"""One Python process per host of the simulated cluster, joined by gloo on the hosts' own interfaces.

Both cluster benchmarks start their hosts the same way: ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` (host 0's address on the bridge),
``MASTER_PORT`` and ``GLOO_SOCKET_IFNAME`` set for ``env://``
initialisation, one CPU thread each (the hosts share this machine's cores),
the repository on ``PYTHONPATH``, and each host's output in a log file of
its own. :func:`start_hosts` starts them; :meth:`Hosts.check` raises, with
the end of the failed host's log, once one has failed.

    >>> env = host_env(rank=2, hosts=4, master_addr="10.0.0.1", port=29500, base={"PYTHONPATH": "/x"})
    >>> env["RANK"], env["WORLD_SIZE"], env["MASTER_ADDR"], env["OMP_NUM_THREADS"], env["PYTHONPATH"].endswith("/x")
    ('2', '4', '10.0.0.1', '1', True)
"""

from __future__ import annotations

import os
import sys
from typing import Dict, List, Mapping, Optional, Sequence

from cluster import IFNAME, Cluster

__all__ = ["REPO", "host_env", "log_tail", "Hosts", "start_hosts"]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def host_env(rank: int, hosts: int, master_addr: str, port: int,
             base: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """The environment of host ``rank``'s process: ``base`` (default: this process's) plus gloo's and ours."""
    base = dict(os.environ if base is None else base)
    path = os.pathsep.join(p for p in (REPO, base.get("PYTHONPATH")) if p)
    return dict(base, RANK=str(rank), WORLD_SIZE=str(hosts), MASTER_ADDR=master_addr, MASTER_PORT=str(port),
                GLOO_SOCKET_IFNAME=IFNAME, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=path)


def log_tail(path: str, lines: int = 30) -> str:
    """The last ``lines`` lines of a host's log, or ``(no log)``."""
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return "(no log)"


class Hosts:
    """The hosts' processes and their logs."""

    def __init__(self, procs: List, logs: List[str]) -> None:
        self.procs, self.logs = procs, logs

    def codes(self) -> List[Optional[int]]:
        """Each process's exit code, None while it runs."""
        return [p.poll() for p in self.procs]

    def all_done(self) -> bool:
        return all(code == 0 for code in self.codes())

    def check(self, what: str) -> None:
        """RuntimeError naming ``what`` ran, the first failed host and the end of its log, if one has failed."""
        for rank, code in enumerate(self.codes()):
            if code not in (None, 0):
                raise RuntimeError(f"{what}: host {rank} of {len(self.procs)} exited with code {code}; the end of "
                                   f"its log ({self.logs[rank]}):\n{log_tail(self.logs[rank])}")


def start_hosts(cluster: Cluster, hosts: int, argv: Sequence[str], port: int, log_folder: str) -> Hosts:
    """Start ``python argv...`` on hosts ``0 .. hosts-1`` of ``cluster``, logs in ``log_folder/host<rank>.log``."""
    procs, logs = [], []
    for rank in range(hosts):
        env = host_env(rank, hosts, cluster.address(0), port)
        logs.append(os.path.join(log_folder, f"host{rank}.log"))
        with open(logs[-1], "w") as log:
            procs.append(cluster.popen(rank, [sys.executable, *argv], env=env, stdout=log, stderr=log))
    return Hosts(procs, logs)

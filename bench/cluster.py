"""A small simulated cluster on one Linux machine: network namespaces on a private bridge, shaped with tc.

For ``N`` hosts, owned by the process ``P`` that builds them::

    namespace ddphb-P-0   eth0 10.213.0.10/24 ==veth== ddhPv0 --+
    namespace ddphb-P-1   eth0 10.213.0.11/24 ==veth== ddhPv1 --+-- bridge ddhPb (no address)
    ...                                                         |

* Each host is a network namespace with its loopback and one veth interface
  ``eth0``; the other end of the veth is a port of a bridge made for this
  cluster alone. Addresses exist only inside the namespaces; the bridge has
  none and the namespaces have no default route, so a host reaches the other
  hosts and nothing else. Names carry the owner's pid, so concurrent runs do
  not collide and a crashed run's leftovers are recognised by a dead pid.
* Bandwidth (:meth:`Cluster.set_rate`): a token-bucket filter (``tc tbf``) on
  both ends of every veth, so a host sends at most ``rate`` and receives at
  most ``rate``, like a full-duplex network card; ``None`` removes the filters
  (the veths' own speed, CPU-bound).
* Nodes (``Cluster(hosts, nodes=M)``): the hosts form ``M`` nodes of
  consecutive hosts. Each node has a bridge of its own (``ddhPn<g>b``),
  unshaped, and one uplink, a veth pair from it (``ddhPu<g>``) to the cluster
  bridge (``ddhPw<g>``). :meth:`Cluster.set_rate` then shapes both ends of
  each uplink instead of the hosts: traffic inside a node is unshaped, and
  the hosts of a node share its ``rate`` to the other nodes each way, as
  GPUs share a node's network card. :meth:`Cluster.uplink_bytes` counts what
  each node sent to the others.
* Teardown (:meth:`Cluster.close`, idempotent): stop the processes started with
  :meth:`Cluster.popen` (SIGTERM, then SIGKILL), kill whatever else still runs
  inside the namespaces, delete the namespaces (their veths go with them) and
  the bridge. It runs on leaving the ``with`` block, at interpreter exit
  (``atexit``), on SIGINT (KeyboardInterrupt) and on SIGTERM/SIGHUP, which
  :func:`exit_on_signals` turns into ``SystemExit``. Only SIGKILL skips it:
  :func:`remove_stale` (called by :meth:`Cluster.open`) removes what a dead
  owner left. Children get ``PR_SET_PDEATHSIG`` so they die with their owner.

Building one needs root and iproute2 (``ip``, ``tc``); :func:`check_prerequisites`
refuses otherwise with a message that says what is missing.

Example (as root)::

    with Cluster(hosts=2) as cluster:
        cluster.set_rate("100mbit")
        proc = cluster.popen(0, ["python", "-c", "print('hello from host 0')"])
        proc.wait()
"""

from __future__ import annotations

import atexit
import ctypes
import os
import re
import shutil
import signal
import subprocess
import time
from typing import Callable, Dict, Iterable, List, Optional, Sequence

__all__ = ["ClusterError", "Cluster", "check_prerequisites", "parse_rate", "tbf_args", "ns_name", "bridge_name",
           "veth_name", "owner_pid", "stale_names", "remove_stale", "exit_on_signals", "IFNAME", "SUBNET"]

NS_PREFIX = "ddphb-"  # namespaces: ddphb-<pid>-<host>
LINK_PREFIX = "ddh"  # links (at most 15 characters): ddh<pid>b (bridge), ddh<pid>v<host> (bridge end of a veth)
IFNAME = "eth0"  # the host's end of its veth, inside its namespace
SUBNET = "10.213.0"  # /24, private, only inside the namespaces; host i is SUBNET.(10 + i)
MAX_HOSTS = 200

_RATE = re.compile(r"^(\d+(?:\.\d+)?)(kbit|mbit|gbit)$")
_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}  # tc's units are powers of 1000
_NS_NAME = re.compile(r"^ddphb-(\d+)-(\d+)$")
_LINK_NAME = re.compile(r"^ddh(\d+)(?:b|v\d+|n\d+b|u\d+|w\d+)$")


class ClusterError(RuntimeError):
    """The cluster cannot be built or changed; the message says what failed and why."""


Runner = Callable[[Sequence[str]], str]


def _run(argv: Sequence[str]) -> str:
    """Run an iproute2 command; its stdout, or ClusterError with the command and its stderr."""
    done = subprocess.run(list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise ClusterError(f"`{' '.join(argv)}` failed (exit {done.returncode}): {done.stderr.strip()}")
    return done.stdout


def check_prerequisites() -> None:
    """Raise ClusterError unless this process is root and iproute2's ``ip`` and ``tc`` are on the PATH."""
    uid = os.geteuid()
    if uid != 0:
        raise ClusterError(f"the simulated cluster needs root (effective uid 0, this process has {uid}): "
                           "it creates network namespaces, veth pairs, a bridge and tc qdiscs; run it with sudo")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise ClusterError(f"the simulated cluster needs iproute2, but {' and '.join(missing)} "
                           f"{'is' if len(missing) == 1 else 'are'} not on the PATH; install it "
                           "(e.g. `apt-get install iproute2`)")


def parse_rate(rate: Optional[str]) -> Optional[float]:
    """``"100mbit"`` -> ``1e8`` bits/s; ``None`` or ``"unshaped"`` -> ``None``.

    >>> parse_rate("100mbit"), parse_rate("1gbit"), parse_rate("unshaped")
    (100000000.0, 1000000000.0, None)
    >>> parse_rate("fast")
    Traceback (most recent call last):
    ...
    ValueError: rate must be a number followed by kbit, mbit or gbit (e.g. 100mbit), or unshaped; got 'fast'
    """
    if rate is None or rate == "unshaped":
        return None
    match = _RATE.match(rate) if isinstance(rate, str) else None
    if match is None or float(match.group(1)) <= 0:
        raise ValueError(f"rate must be a number followed by kbit, mbit or gbit (e.g. 100mbit), or unshaped; "
                         f"got {rate!r}")
    return float(match.group(1)) * _UNITS[match.group(2)]


def tbf_args(rate: str) -> List[str]:
    """tc arguments of the token bucket for ``rate``: a burst of 2 ms of traffic (at least 64 kB, one
    TSO segment) and a queue of 100 ms (at least 256 kB), so a step's megabytes go at the rate.

    >>> tbf_args("100mbit")
    ['tbf', 'rate', '100mbit', 'burst', '65536', 'limit', '1250000']
    """
    bits = parse_rate(rate)
    if bits is None:
        raise ValueError("tbf_args needs a rate, not unshaped")
    burst = max(65536, int(bits / 8 * 0.002))
    limit = max(262144, int(bits / 8 * 0.1))
    return ["tbf", "rate", rate, "burst", str(burst), "limit", str(limit)]


def ns_name(pid: int, host: int) -> str:
    return f"{NS_PREFIX}{pid}-{host}"


def bridge_name(pid: int) -> str:
    return f"{LINK_PREFIX}{pid}b"


def veth_name(pid: int, host: int) -> str:
    return f"{LINK_PREFIX}{pid}v{host}"


def node_bridge_name(pid: int, node: int) -> str:
    return f"{LINK_PREFIX}{pid}n{node}b"


def uplink_names(pid: int, node: int) -> tuple:
    """A node's uplink: its end in the node's bridge, and its end in the cluster bridge."""
    return f"{LINK_PREFIX}{pid}u{node}", f"{LINK_PREFIX}{pid}w{node}"


def owner_pid(name: str) -> Optional[int]:
    """The pid in a name made by this module, else None.

    >>> owner_pid("ddphb-123-0"), owner_pid("ddh123b"), owner_pid("ddh123v4"), owner_pid("eth0")
    (123, 123, 123, None)
    """
    match = _NS_NAME.match(name) or _LINK_NAME.match(name)
    return int(match.group(1)) if match else None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stale_names(names: Iterable[str], alive: Optional[Callable[[int], bool]] = None) -> List[str]:
    """The names made by this module whose owner process is gone.

    >>> stale_names(["ddphb-1-0", "ddh1b", "ddphb-2-0", "other"], alive=lambda pid: pid == 2)
    ['ddphb-1-0', 'ddh1b']
    """
    alive = _pid_alive if alive is None else alive
    out = []
    for name in names:
        pid = owner_pid(name)
        if pid is not None and not alive(pid):
            out.append(name)
    return out


def _list_namespaces(run: Runner) -> List[str]:
    # `ip netns list` prints "name" or "name (id: 3)" per line
    return [line.split()[0] for line in run(["ip", "netns", "list"]).splitlines() if line.strip()]


def _list_links(run: Runner) -> List[str]:
    # `ip -o link show` prints "7: name@peer: <...> ..." per line
    names = []
    for line in run(["ip", "-o", "link", "show"]).splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            names.append(parts[1].strip().split("@")[0])
    return names


def _kill_namespace_processes(ns: str, run: Runner) -> None:
    """SIGKILL what still runs in ``ns`` (only processes started there by a run of this module)."""
    try:
        pids = [int(p) for p in run(["ip", "netns", "pids", ns]).split()]
    except ClusterError:
        return
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def remove_stale(run: Runner = _run, alive: Optional[Callable[[int], bool]] = None) -> List[str]:
    """Delete the namespaces and links this module made for owners that no longer exist; return their names."""
    removed = []
    namespaces = stale_names(_list_namespaces(run), alive)
    for ns in namespaces:
        _kill_namespace_processes(ns, run)
    # veths first (deleting one end deletes the pair at once), then bridges, then namespaces
    for link in sorted(stale_names(_list_links(run), alive), key=lambda name: name.endswith("b")):
        try:
            run(["ip", "link", "delete", link])
        except ClusterError:  # gone meanwhile
            continue
        removed.append(link)
    for ns in namespaces:
        run(["ip", "netns", "delete", ns])
        removed.append(ns)
    return removed


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1; kept across exec of ordinary programs


def exit_on_signals(signals: Sequence[int] = (signal.SIGTERM, signal.SIGHUP)) -> Dict[int, object]:
    """Make ``signals`` raise SystemExit and SIGINT KeyboardInterrupt, so ``finally`` blocks run.

    SIGINT is set explicitly: a process started in the background by a
    non-interactive shell inherits it ignored, and Python then leaves it so.
    Returns the previous handlers, for :func:`signal.signal` to restore.
    """
    def handler(signum, frame):
        raise SystemExit(128 + signum)

    previous = {s: signal.signal(s, handler) for s in signals}
    previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    return previous


class Cluster:
    """``hosts`` network namespaces on a private bridge; see the module docstring.

    Args:
        hosts (int): number of hosts, 1 to 200.
        run: executes an iproute2 command given as a list and returns its
            stdout, raising ClusterError on failure (tests pass a fake).
        pid (int): the owner's pid used in the names (default: this process).
    """

    def __init__(self, hosts: int, run: Runner = _run, pid: Optional[int] = None, nodes: int = 1):
        if not isinstance(hosts, int) or isinstance(hosts, bool) or not 1 <= hosts <= MAX_HOSTS:
            raise ValueError(f"`hosts` must be an int in [1, {MAX_HOSTS}], got {hosts!r}; "
                             f"host i has the address {SUBNET}.(10 + i)")
        if not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 1 or hosts % nodes:
            raise ValueError(f"`nodes` must be an int >= 1 that divides `hosts`={hosts}, got {nodes!r}; "
                             "each node holds the same number of consecutive hosts")
        self.hosts = hosts
        self.nodes = nodes
        self.pid = os.getpid() if pid is None else pid
        self.rate: Optional[str] = None
        self._run = run
        self._made: List[tuple] = []  # what exists, in creation order: ("ns", name) / ("link", name)
        self._procs: List[subprocess.Popen] = []
        self._open = False

    # ----- names and addresses -----
    def namespace(self, host: int) -> str:
        return ns_name(self.pid, host)

    def address(self, host: int) -> str:
        return f"{SUBNET}.{10 + host}"

    @property
    def bridge(self) -> str:
        return bridge_name(self.pid)

    def node_of(self, host: int) -> int:
        return host // (self.hosts // self.nodes)

    # ----- building -----
    def open(self) -> "Cluster":
        """Remove stale leftovers, then build the bridge, namespaces and veths (torn down again on failure)."""
        if self._open:
            raise ClusterError("this cluster is already open")
        check_prerequisites()
        remove_stale(self._run)
        self._open = True
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _build(self) -> None:
        run, bridge = self._run, self.bridge
        run(["ip", "link", "add", bridge, "type", "bridge"])
        self._made.append(("link", bridge))
        run(["ip", "link", "set", bridge, "up"])
        node_bridges = [bridge] * self.nodes
        if self.nodes > 1:  # a bridge per node, joined to the cluster bridge by its uplink
            for node in range(self.nodes):
                node_bridges[node] = node_bridge_name(self.pid, node)
                inner, outer = uplink_names(self.pid, node)
                run(["ip", "link", "add", node_bridges[node], "type", "bridge"])
                self._made.append(("link", node_bridges[node]))
                run(["ip", "link", "set", node_bridges[node], "up"])
                run(["ip", "link", "add", inner, "type", "veth", "peer", "name", outer])
                self._made.append(("link", inner))
                for end, master in ((inner, node_bridges[node]), (outer, bridge)):
                    run(["ip", "link", "set", end, "master", master])
                    run(["ip", "link", "set", end, "up"])
        for host in range(self.hosts):
            ns, outer = self.namespace(host), veth_name(self.pid, host)
            run(["ip", "netns", "add", ns])
            self._made.append(("ns", ns))
            run(["ip", "link", "add", outer, "type", "veth", "peer", "name", IFNAME, "netns", ns])
            # deleting this end deletes the pair at once; a deleted namespace frees its end only later
            self._made.append(("link", outer))
            run(["ip", "link", "set", outer, "master", node_bridges[self.node_of(host)]])
            run(["ip", "link", "set", outer, "up"])
            run(["ip", "-n", ns, "link", "set", "lo", "up"])
            run(["ip", "-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", IFNAME])
            run(["ip", "-n", ns, "link", "set", IFNAME, "up"])

    def __enter__(self) -> "Cluster":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    # ----- bandwidth -----
    def set_rate(self, rate: Optional[str]) -> None:
        """Shape every host (with nodes: every node's uplink) to ``rate`` each way (e.g. ``"100mbit"``), or
        unshape with ``None``/``"unshaped"``."""
        bits = parse_rate(rate)
        if not self._open:
            raise ClusterError("set_rate() needs an open cluster")
        if self.nodes > 1:
            ends = [(["tc"], end) for node in range(self.nodes) for end in uplink_names(self.pid, node)]
        else:
            ends = [(prefix, dev) for host in range(self.hosts)
                    for prefix, dev in ((["tc"], veth_name(self.pid, host)), (["tc", "-n", self.namespace(host)],
                                                                               IFNAME))]
        for prefix, dev in ends:
            if bits is None:
                if self.rate is not None:
                    self._run(prefix + ["qdisc", "del", "dev", dev, "root"])
            else:
                self._run(prefix + ["qdisc", "replace", "dev", dev, "root"] + tbf_args(rate))
        self.rate = None if bits is None else rate

    def uplink_bytes(self) -> List[int]:
        """Per node, the bytes it has sent to the other nodes (its uplink's counter); needs ``nodes`` > 1."""
        if self.nodes == 1:
            raise ClusterError("uplink_bytes() needs a cluster of several nodes")
        counts = []
        for node in range(self.nodes):
            path = f"/sys/class/net/{uplink_names(self.pid, node)[0]}/statistics/tx_bytes"
            with open(path) as f:
                counts.append(int(f.read()))
        return counts

    # ----- processes -----
    def popen(self, host: int, argv: Sequence[str], env: Optional[Dict[str, str]] = None, **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside host ``host``'s namespace; it is stopped by :meth:`close` and dies with us."""
        if not self._open:
            raise ClusterError("popen() needs an open cluster")
        if not 0 <= host < self.hosts:
            raise ValueError(f"`host` must be in [0, {self.hosts}), got {host}")
        proc = subprocess.Popen(["ip", "netns", "exec", self.namespace(host), *argv], env=env,
                                start_new_session=True, preexec_fn=_die_with_parent, **kwargs)
        self._procs.append(proc)
        return proc

    def _stop_processes(self, grace: float = 3.0) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + grace
        for proc in self._procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._procs = []

    # ----- teardown -----
    def close(self) -> None:
        """Stop our processes, delete namespaces and the bridge; safe to call twice and while signals arrive."""
        if not self._open:
            return
        blocked = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
        try:
            self._stop_processes()
            errors = []
            for kind, name in reversed(self._made):
                try:
                    if kind == "ns":
                        _kill_namespace_processes(name, self._run)
                        self._run(["ip", "netns", "delete", name])
                    else:
                        self._run(["ip", "link", "delete", name])
                except ClusterError as exc:
                    errors.append(str(exc))
            self._made = []
            self._open = False
            self.rate = None
            atexit.unregister(self.close)
            if errors:
                raise ClusterError("teardown left something behind: " + "; ".join(errors))
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)

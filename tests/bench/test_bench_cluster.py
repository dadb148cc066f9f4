"""The cluster benchmark (bench/cluster*.py, bench/bench_cluster.py) without root, and one real cluster with it.

Most tests drive :class:`cluster.Cluster` through a fake iproute2 that records
commands, so they check names, the order of creation and teardown, shaping
and the refusals on any machine. ``test_real_cluster`` builds two namespaces
and is skipped unless this process is root with iproute2 and may create
network namespaces.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from paths import ROOT

sys.path.insert(0, os.path.join(ROOT, "recipes"))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import bench_cluster  # noqa: E402
import cluster  # noqa: E402
import cluster_control  # noqa: E402
import cluster_hosts  # noqa: E402
import cluster_plan  # noqa: E402
import cluster_report  # noqa: E402
from cluster import Cluster, ClusterError  # noqa: E402


class FakeIproute:
    """Records iproute2 commands; lists preset namespaces and links; fails on the command ``fail_on`` accepts."""

    def __init__(self, namespaces=(), links=(), fail_on=None):
        self.namespaces, self.links, self.fail_on = list(namespaces), list(links), fail_on
        self.calls = []

    def __call__(self, argv):
        argv = list(argv)
        self.calls.append(argv)
        if self.fail_on is not None and self.fail_on(argv):
            raise ClusterError(f"`{' '.join(argv)}` failed (exit 2): fake failure")
        if argv[:3] == ["ip", "netns", "list"]:
            return "".join(f"{name} (id: {i})\n" for i, name in enumerate(self.namespaces))
        if argv[:4] == ["ip", "-o", "link", "show"]:
            return "".join(f"{i}: {name}@if2: <BROADCAST,UP> mtu 1500\n" for i, name in enumerate(self.links))
        return ""

    def changes(self):
        """The commands that change something (not the listings)."""
        return [c for c in self.calls if c[:3] not in (["ip", "netns", "list"], ["ip", "-o", "link"],
                                                       ["ip", "netns", "pids"])]


@pytest.fixture
def as_root(monkeypatch):
    monkeypatch.setattr(cluster.os, "geteuid", lambda: 0)
    monkeypatch.setattr(cluster.shutil, "which", lambda tool: f"/sbin/{tool}")


# ----- refusals -----
def test_refuses_without_root(monkeypatch):
    monkeypatch.setattr(cluster.os, "geteuid", lambda: 1000)
    with pytest.raises(ClusterError, match=r"needs root \(effective uid 0, this process has 1000\).*sudo"):
        cluster.check_prerequisites()
    fake = FakeIproute()
    with pytest.raises(ClusterError, match="needs root"):
        Cluster(2, run=fake).open()
    assert fake.calls == []  # refused before any command


@pytest.mark.parametrize("missing, match", [
    ({"tc"}, "needs iproute2, but tc is not on the PATH"),
    ({"ip", "tc"}, "needs iproute2, but ip and tc are not on the PATH"),
])
def test_refuses_without_iproute2(monkeypatch, missing, match):
    monkeypatch.setattr(cluster.os, "geteuid", lambda: 0)
    monkeypatch.setattr(cluster.shutil, "which", lambda tool: None if tool in missing else f"/sbin/{tool}")
    with pytest.raises(ClusterError, match=match):
        cluster.check_prerequisites()


def test_bench_refuses_before_writing_anything(monkeypatch, tmp_path):
    monkeypatch.setattr(cluster.os, "geteuid", lambda: 1000)
    out = tmp_path / "r.jsonl"
    with pytest.raises(SystemExit, match="^bench_cluster: the simulated cluster needs root"):
        bench_cluster.main(bench_cluster.parse_args(["--quick", "--out", str(out)]))
    assert not out.exists()


def test_cluster_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"`hosts` must be an int in \[1, 200\], got 0"):
        Cluster(0)
    with pytest.raises(ClusterError, match="needs an open cluster"):
        Cluster(2, run=FakeIproute()).set_rate("1gbit")


# ----- names -----
def test_names_fit_linux_limits_and_parse_back():
    pid_max = 4194304  # the kernel's largest pid_max
    assert len(cluster.bridge_name(pid_max)) <= 15 and len(cluster.veth_name(pid_max, 199)) <= 15
    for name in (cluster.ns_name(pid_max, 3), cluster.bridge_name(pid_max), cluster.veth_name(pid_max, 199)):
        assert cluster.owner_pid(name) == pid_max
    for foreign in ("eth0", "ddh", "ddh12", "ddh12vx", "ddphb-x-1", "ddphb-12", "br-ddh12b", "ddh12b0"):
        assert cluster.owner_pid(foreign) is None, foreign


def test_stale_names_are_those_of_dead_owners():
    names = ["ddphb-1-0", "ddphb-2-0", "ddh1b", "ddh1v0", "ddh2v0", "lo", "ddphb-ctl"]
    assert cluster.stale_names(names, alive=lambda pid: pid == 2) == ["ddphb-1-0", "ddh1b", "ddh1v0"]


def test_remove_stale_deletes_dead_owners_only():
    fake = FakeIproute(namespaces=["ddphb-111-0", "ddphb-111-1", "ddphb-222-0", "other"],
                       links=["lo", "ddh111b", "ddh111v0", "ddh111v1", "ddh222b", "ddh222v0"])
    removed = cluster.remove_stale(fake, alive=lambda pid: pid == 222)
    assert fake.changes() == [
        ["ip", "link", "delete", "ddh111v0"], ["ip", "link", "delete", "ddh111v1"],  # veths before their bridge
        ["ip", "link", "delete", "ddh111b"],
        ["ip", "netns", "delete", "ddphb-111-0"], ["ip", "netns", "delete", "ddphb-111-1"],
    ]
    assert ["ip", "netns", "pids", "ddphb-111-0"] in fake.calls  # what runs there is killed first
    assert sorted(removed) == ["ddh111b", "ddh111v0", "ddh111v1", "ddphb-111-0", "ddphb-111-1"]


# ----- building, shaping, teardown -----
def test_cluster_builds_private_hosts_and_tears_down_in_reverse(as_root, monkeypatch):
    monkeypatch.setattr(cluster, "_pid_alive", lambda pid: pid == 77)
    fake = FakeIproute(namespaces=["ddphb-5-0"], links=["ddh5b"])  # a dead owner's leftovers
    c = Cluster(2, run=fake, pid=77)
    with c:
        built = fake.changes()
        assert built[:3] == [["ip", "link", "delete", "ddh5b"], ["ip", "netns", "delete", "ddphb-5-0"],
                             ["ip", "link", "add", "ddh77b", "type", "bridge"]]
        assert ["ip", "link", "add", "ddh77v1", "type", "veth", "peer", "name", "eth0", "netns", "ddphb-77-1"] in built
        assert ["ip", "link", "set", "ddh77v1", "master", "ddh77b"] in built
        assert [c_ for c_ in built if "addr" in c_] == [
            ["ip", "-n", "ddphb-77-0", "addr", "add", "10.213.0.10/24", "dev", "eth0"],
            ["ip", "-n", "ddphb-77-1", "addr", "add", "10.213.0.11/24", "dev", "eth0"]]
        assert not any("route" in c_ for c_ in built)  # no default route: hosts reach each other only
        assert (c.address(1), c.namespace(1), c.bridge) == ("10.213.0.11", "ddphb-77-1", "ddh77b")
        fake.calls.clear()
    assert fake.changes() == [["ip", "link", "delete", "ddh77v1"], ["ip", "netns", "delete", "ddphb-77-1"],
                              ["ip", "link", "delete", "ddh77v0"], ["ip", "netns", "delete", "ddphb-77-0"],
                              ["ip", "link", "delete", "ddh77b"]]
    fake.calls.clear()
    c.close()  # idempotent
    assert fake.calls == []


def test_failed_build_removes_what_it_made(as_root):
    fake = FakeIproute(fail_on=lambda argv: argv == ["ip", "netns", "add", "ddphb-9-1"])
    c = Cluster(2, run=fake, pid=9)
    with pytest.raises(ClusterError, match="ip netns add ddphb-9-1.*fake failure"):
        c.open()
    deleted = [argv for argv in fake.changes() if "delete" in argv]
    assert deleted == [["ip", "link", "delete", "ddh9v0"], ["ip", "netns", "delete", "ddphb-9-0"],
                       ["ip", "link", "delete", "ddh9b"]]
    fake.calls.clear()
    c.close()
    assert fake.calls == []


def test_nodes_have_bridges_of_their_own_and_only_their_uplinks_are_shaped(as_root):
    fake = FakeIproute()
    with Cluster(4, run=fake, pid=3, nodes=2) as c:
        built = fake.changes()
        for node, hosts in ((0, (0, 1)), (1, (2, 3))):
            assert ["ip", "link", "add", f"ddh3n{node}b", "type", "bridge"] in built
            assert ["ip", "link", "add", f"ddh3u{node}", "type", "veth", "peer", "name", f"ddh3w{node}"] in built
            assert ["ip", "link", "set", f"ddh3u{node}", "master", f"ddh3n{node}b"] in built
            assert ["ip", "link", "set", f"ddh3w{node}", "master", "ddh3b"] in built
            for host in hosts:
                assert ["ip", "link", "set", f"ddh3v{host}", "master", f"ddh3n{node}b"] in built
        fake.calls.clear()
        c.set_rate("100mbit")
        tbf = ["tbf", "rate", "100mbit", "burst", "65536", "limit", "1250000"]
        assert fake.changes() == [["tc", "qdisc", "replace", "dev", dev, "root"] + tbf
                                  for dev in ("ddh3u0", "ddh3w0", "ddh3u1", "ddh3w1")]
        fake.calls.clear()
    deleted = fake.changes()
    assert deleted[-3:] == [["ip", "link", "delete", "ddh3u0"], ["ip", "link", "delete", "ddh3n0b"],
                            ["ip", "link", "delete", "ddh3b"]]  # the cluster bridge last
    assert cluster.owner_pid("ddh3n1b") == cluster.owner_pid("ddh3u1") == cluster.owner_pid("ddh3w0") == 3
    with pytest.raises(ValueError, match="divides `hosts`=4"):
        Cluster(4, nodes=3)


def test_set_rate_shapes_both_ends_of_every_veth(as_root):
    fake = FakeIproute()
    with Cluster(2, run=fake, pid=3) as c:
        fake.calls.clear()
        c.set_rate("100mbit")
        tbf = ["tbf", "rate", "100mbit", "burst", "65536", "limit", "1250000"]
        assert fake.changes() == [
            ["tc", "qdisc", "replace", "dev", "ddh3v0", "root"] + tbf,
            ["tc", "-n", "ddphb-3-0", "qdisc", "replace", "dev", "eth0", "root"] + tbf,
            ["tc", "qdisc", "replace", "dev", "ddh3v1", "root"] + tbf,
            ["tc", "-n", "ddphb-3-1", "qdisc", "replace", "dev", "eth0", "root"] + tbf]
        fake.calls.clear()
        c.set_rate("unshaped")
        assert [argv[-4:] for argv in fake.changes()] == [["del", "dev", "ddh3v0", "root"],
                                                          ["del", "dev", "eth0", "root"],
                                                          ["del", "dev", "ddh3v1", "root"],
                                                          ["del", "dev", "eth0", "root"]]
        fake.calls.clear()
        c.set_rate(None)  # already unshaped: nothing to delete
        assert fake.calls == [] and c.rate is None
        with pytest.raises(ValueError, match="rate must be a number followed by kbit, mbit or gbit"):
            c.set_rate("100")


def test_tbf_burst_and_queue_scale_with_the_rate():
    assert cluster.tbf_args("1gbit") == ["tbf", "rate", "1gbit", "burst", "250000", "limit", "12500000"]
    assert cluster.parse_rate("2.5gbit") == 2.5e9
    for bad in ("0mbit", "100 mbit", "1tbit", 100):
        with pytest.raises(ValueError, match="rate must be"):
            cluster.parse_rate(bad)


def test_signals_become_exceptions():
    previous = cluster.exit_on_signals()
    try:
        with pytest.raises(SystemExit) as info:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)  # the handler runs at the next bytecode
        assert info.value.code == 128 + signal.SIGTERM
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# ----- the rank/controller handshake -----
def test_rank_control_waits_for_the_controller(tmp_path):
    folder, barriers, applied = str(tmp_path), [], []

    def controller():
        for seq in range(2):
            while cluster_control.pending_request(folder, seq) is None:
                time.sleep(0.001)
            applied.append(cluster_control.pending_request(folder, seq))
            cluster_control.write_atomic(cluster_control.ack_path(folder, seq), "")

    thread = threading.Thread(target=controller)
    thread.start()
    control = cluster_control.RankControl(folder, 0, timeout=30, barrier=lambda: barriers.append(1))
    control.switch("unshaped")  # the cluster starts unshaped: nothing to ask
    control.switch("1gbit")
    control.switch("1gbit")
    control.switch("100mbit")
    thread.join(30)
    assert applied == ["1gbit", "100mbit"] and len(barriers) == 2 and control.seq == 2


def test_rank_control_times_out_without_a_controller(tmp_path):
    control = cluster_control.RankControl(str(tmp_path), 1, timeout=0.05, barrier=lambda: None)
    with pytest.raises(TimeoutError, match=r"no answer from the controller to request 0 \(100mbit\)"):
        control.switch("100mbit")
    assert not os.listdir(tmp_path)  # only rank 0 writes requests


# ----- the plan -----
def test_plan_has_every_configuration_of_the_issue():
    methods = cluster_plan.all_methods()
    sparse = {(m.method, m.density, m.scope, m.aggregation) for m in methods if m.hook == "sparsify"}
    assert len(sparse) == 30 and ("topk", 0.01, "layer", "allreduce") not in sparse
    assert {(m.label, m.powersgd_rank) for m in methods if m.hook == "powersgd"} == {
        ("PowerSGD rank 1", 1), ("PowerSGD rank 4", 4)}
    assert [m.period for m in methods if m.optimizer == "local_adaalter"] == [4, 8]
    assert [m.group_per_bucket for m in methods].count(True) == 2
    assert len(set(methods)) == len(methods) == 39
    assert cluster_plan.NOOP in methods and cluster_plan.NOOP in cluster_plan.headline_methods()
    assert methods[0].hook == methods[-1].hook == "allreduce" and methods[-1].label == "allreduce hook, again"
    quick = cluster_plan.quick_plan()
    assert {(r.hosts, r.model) for r in quick} == {(2, "resnet20"), (4, "resnet20"), (4, "resnet18")}
    assert all(tuple(r.bandwidths) == ("1gbit", "100mbit") for r in quick)


def test_every_method_builds_with_the_recipe():
    import torch
    from comm_setup import build_exchange, build_optimizer

    model = torch.nn.Linear(3, 2)
    for method in cluster_plan.all_methods() + cluster_plan.summary_methods():
        args = method.recipe_args()
        exchange = build_exchange(args)
        build_optimizer(args, model.parameters(), exchange)
        assert exchange.kind == method.hook


def test_plans_by_host_and_node_count():
    plan = bench_cluster.build_plan(bench_cluster.parse_args(["--headline", "--rounds", "2"]))
    assert list(plan) == [(4, 1)] and [(r.model, r.round) for r in plan[4, 1]] == [("resnet18", 0), ("resnet18", 1)]
    plan = bench_cluster.build_plan(bench_cluster.parse_args(["--quick"]))
    assert {h: [r.model for r in runs] for (h, _), runs in plan.items()} == {2: ["resnet20"],
                                                                            4: ["resnet20", "resnet18"]}
    plan = bench_cluster.build_plan(bench_cluster.parse_args(["--hosts", "3", "--models", "resnet18"]))
    assert list(plan) == [(3, 1)] and len(plan[3, 1][0].methods) == 39
    plan = bench_cluster.build_plan(bench_cluster.parse_args(
        ["--hosts", "8", "--models", "resnet18", "--bandwidths", "100mbit", "1gbit", "--summary-methods"]))
    (run,) = plan[8, 1]
    assert list(plan) == [(8, 1)] and run.methods == cluster_plan.summary_methods() and len(run.methods) == 13
    plan = bench_cluster.build_plan(bench_cluster.parse_args(["--nodes"]))
    assert list(plan) == [(4, 2), (8, 2)]
    assert [m.ranks_per_node for m in plan[8, 2][0].methods] == [0, 4, 0, 4]
    assert plan[4, 2][0].methods[3].optimizer == cluster_plan.HIERARCHICAL_AVERAGER
    assert tuple(run.bandwidths) == ("1gbit", "100mbit")
    with pytest.raises(SystemExit):
        bench_cluster.parse_args(["--headline", "--summary-methods"])


def test_bandwidths_are_measured_fastest_first():
    args = bench_cluster.parse_args(["--bandwidths", "100mbit", "unshaped", "1gbit"])
    assert args.bandwidths == ["unshaped", "1gbit", "100mbit"]
    for argv in (["--bandwidths", "fast"], ["--quick", "--hosts", "4"], ["--hosts", "1"], ["--quick", "--headline"],
                 ["--headline", "--models", "resnet18"], ["--rounds", "0"]):
        with pytest.raises(SystemExit):
            bench_cluster.parse_args(argv)


# ----- reporting -----
def _record(label, hook, s, bandwidth="100mbit", optimizer="sgd", **kw):
    r = {"model": "resnet18", "hosts": 4, "bandwidth": bandwidth, "label": label, "hook": hook,
         "optimizer": optimizer, "method": None, "density": None, "scope": None, "aggregation": None,
         "powersgd_rank": None, "period": None, "params": 11_173_962, "s_per_step": s, "s_per_step_max_rank": s, "payload_bytes_per_step": 1000.0,
         "wire_bytes_per_step": 1500.0, "dense_bytes_per_step": 4000.0, "forward_s": 0.1, "backward_s": 0.2, "exchange_s": 0.3,
         "compression_s": 0.01, "optimizer_s": 0.02}
    r.update(kw)
    return r


def test_tables_compare_with_the_allreduce_row_of_the_same_cluster():
    block = dict(method="random_block", density=0.01, scope="layer", aggregation="allreduce")
    records = [
        _record("allreduce hook", "allreduce", 6.0), _record("random-block", "sparsify", 1.0, **block),
        _record("PowerSGD rank 4", "powersgd", 1.5, powersgd_rank=4),
        _record("sync AdaGrad", "allreduce", 3.0, optimizer="adagrad"),
        _record("allreduce hook", "allreduce", 1.3, bandwidth="1gbit"),
        _record("random-block", "sparsify", 1.0, bandwidth="1gbit", **block),
    ]
    groups = cluster_report.group_records(records)
    assert list(groups) == [("resnet18", 4, "100mbit"), ("resnet18", 4, "1gbit")]
    table = cluster_report.format_table(groups[("resnet18", 4, "100mbit")])
    assert "| random-block | 0.01, layer, allreduce | 1.000 | 6.00x |" in table
    assert "| sync AdaGrad |  | 3.000 | 2.00x |" in table  # against the allreduce hook, not itself
    again = _record("allreduce hook, again", "allreduce", 4.0)
    assert cluster_report.baseline(groups[("resnet18", 4, "100mbit")] + [again]) == 5.0  # the mean of both
    targets = cluster_report.format_targets(records)
    assert "100mbit: random-block d=0.01 layer allreduce: 6.00x faster than the allreduce hook (target 5.00x: met)" \
        in targets
    assert "vs PowerSGD rank 4: 1.50x its speed (met)" in targets
    assert "1gbit: random-block d=0.01 layer allreduce: 1.30x faster than the allreduce hook (target 1.37x: MISSED)" \
        in targets


def test_the_noop_hook_is_the_ceiling_of_every_row_and_of_issue_21s_targets():
    block = dict(method="random_block", density=0.01, scope="layer", aggregation="allreduce")
    records = [_record("allreduce hook", "allreduce", 6.0), _record("random-block", "sparsify", 1.04, **block),
               _record("noop hook (no exchange)", "noop", 1.0),
               _record("allreduce hook", "allreduce", 1.3, bandwidth="1gbit"),
               _record("random-block", "sparsify", 1.2, bandwidth="1gbit", **block),
               _record("noop hook (no exchange)", "noop", 1.0, bandwidth="1gbit")]
    groups = cluster_report.group_records(records)
    table = cluster_report.format_table(groups[("resnet18", 4, "100mbit")])
    assert "| speed-up | x noop |" in table
    assert "| random-block | 0.01, layer, allreduce | 1.040 | 5.77x | 1.04x |" in table
    targets = cluster_report.format_targets(records)
    assert "100mbit: random-block d=0.01 layer allreduce: 1.040 s/step, 1.04x the noop hook's 1.000 (target 1.05x: " \
           "met)" in targets
    assert "1gbit: random-block d=0.01 layer allreduce: 1.200 s/step, 1.20x the noop hook's 1.000 (target 1.10x: " \
           "MISSED)" in targets
    without = cluster_report.format_table(groups[("resnet18", 4, "100mbit")][:2])
    assert "x noop" not in without  # a run without the noop row has no such column
    assert "no noop row" in cluster_report.format_targets(records[:2])


def test_summary_and_report_from_a_results_file(tmp_path, capsys):
    import json

    block = dict(method="random_block", density=0.01, scope="layer", aggregation="allreduce")
    topk = dict(method="topk", density=0.1, scope="global", aggregation="allgather")
    records = [_record("allreduce hook", "allreduce", 3.0), _record("random-block", "sparsify", 2.0, **block),
               _record("top-k", "sparsify", 1.0, **topk), _record("allreduce hook, again", "allreduce", 5.0)]
    summary = cluster_report.format_summary(records)
    assert summary.splitlines()[2] == ("| resnet18 | 4 | 100mbit | 4.000 (3.00, 5.00) |  |  |  |  |  |  | 2.00x |  |  |  |  "
                                       "| 4.00x top-k d=0.1 global allgather |")
    path = tmp_path / "r.jsonl"
    run = {"command": "python bench/bench_cluster.py", "wall_s": 12.0, "batch": 4, "image_size": 32, "steps": 3,
           "min_window_s": 0.5}
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + json.dumps({"run": run}) + "\n")
    assert cluster_report.read_results(str(path)) == (records, run)
    bench_cluster.main(bench_cluster.parse_args(["--report", str(path)]))  # no root needed
    out = capsys.readouterr().out
    assert out.startswith("Command: `python bench/bench_cluster.py`; 4 results in 12 s; batch 4 images of 32x32")
    assert summary in out and "### resnet18 (11.17 M parameters), 4 hosts, 100mbit" in out


def test_rounds_repeat_the_plan_and_merge_to_medians():
    runs = cluster_plan.repeat(cluster_plan.headline_plan() + cluster_plan.quick_plan()[:1], 3)
    assert [(r.round, r.model) for r in runs][:3] == [(0, "resnet18"), (0, "resnet20"), (1, "resnet18")]
    rows = [_record("allreduce hook", "allreduce", s, round=k) for k, s in enumerate((3.0, 9.0, 4.0))]
    rows.append(_record("allreduce hook", "allreduce", 1.0, bandwidth="1gbit"))
    merged = cluster_report.merge_rounds(rows)
    assert [(m["bandwidth"], m["s_per_step"], m["rounds"]) for m in merged] == [("100mbit", 4.0, 3), ("1gbit", 1.0, 1)]
    assert merged[0]["s_per_step_rounds"] == [3.0, 9.0, 4.0]
    assert "| allreduce hook |  | 4.000 (3.00-9.00) | 1.00x |" in cluster_report.format_table(merged[:1])


@pytest.mark.parametrize("module", [cluster_hosts, cluster_report], ids=lambda m: m.__name__)
def test_docstring_examples(module):
    import doctest

    assert doctest.testmod(module).failed == 0


def test_a_failed_host_is_reported_with_the_end_of_its_log(tmp_path):
    logs = [str(tmp_path / f"host{rank}.log") for rank in range(2)]
    procs = []
    for rank, code in enumerate(("print('fine')", "import sys; print('line 1'); print('boom'); sys.exit(3)")):
        with open(logs[rank], "w") as log:
            procs.append(subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=log))
    hosts = cluster_hosts.Hosts(procs, logs)
    for p in procs:
        p.wait(30)
    assert not hosts.all_done()
    with pytest.raises(RuntimeError, match=r"(?s)a test run: host 1 of 2 exited with code 3; .*line 1\nboom"):
        hosts.check("a test run")
    assert cluster_hosts.log_tail(str(tmp_path / "missing.log")) == "(no log)"


def test_combine_averages_ranks_per_step():
    import cluster_worker

    ranks = [{"seconds": 2.0, "steps": 4, "step_times": [0.5] * 4, "tx": 400, "sent": 200, "dense": 800,
              "forward": 0.4, "backward": 0.8, "exchange": 0.4, "compression": 0.2, "optimizer": 0.2},
             {"seconds": 4.0, "steps": 4, "step_times": [1.0] * 4, "tx": 800, "sent": 200, "dense": 800,
              "forward": 0.4, "backward": 0.8, "exchange": 2.4, "compression": 0.2, "optimizer": 0.2}]
    out = cluster_worker.combine(ranks)
    assert out["s_per_step"] == 0.75 and out["s_per_step_max_rank"] == 1.0
    assert (out["wire_bytes_per_step"], out["payload_bytes_per_step"], out["exchange_s"]) == (150, 50, 0.35)
    assert out["step_times_rank0"] == [0.5] * 4


# ----- the worker on 2 gloo ranks over loopback -----
def _worker_body(rank, world_size):
    import torch

    import cluster_worker
    from cluster_plan import ADAALTER, ALLREDUCE, POWERSGD, hierarchical_averager, in_nodes, sparsifier

    images, labels = torch.randn(2, 3, 8, 8), torch.randint(0, 10, (2,))
    out, groups = {}, cluster_worker.PerBucketGroups()
    for method in (ALLREDUCE, POWERSGD[1], sparsifier("topk", 0.1, "global", "allgather"), ADAALTER[4],
                   in_nodes(sparsifier("random_block", 0.1, "layer", "allreduce"), 2), hierarchical_averager(2, 1)):
        bench = cluster_worker.MethodBench(method, "resnet20", images, labels, "lo", groups)
        for _ in range(method.untimed_steps):
            bench.step()
        window = bench.window(2, method.step_multiple, 0.0)
        params = sum(p.numel() for p in bench.ddp.parameters())
        out[method.label] = (window, params)
    out["bucket groups"] = len(groups.groups)
    return out


def test_worker_windows_count_steps_bytes_and_phases():
    from ddp_hooks.testing import run_distributed

    results = run_distributed(_worker_body, 2, timeout=240)
    assert results[0].pop("bucket groups") == 2  # resnet20's two DDP buckets, one PowerSGD group each
    for label, (window, params) in results[0].items():
        phases = sum(window[p] for p in ("forward", "backward", "exchange", "compression", "optimizer"))
        assert all(window[p] >= 0 for p in ("forward", "backward", "exchange", "compression", "optimizer")), label
        assert phases <= window["seconds"], label
        assert len(window["step_times"]) == window["steps"]
        if not label.startswith("HierarchicalModelAverager"):  # (its allreduces are not the hook's: below)
            assert window["tx"] >= window["sent"] > 0, label  # loopback carries at least this rank's payload
    allreduce, params = results[0]["allreduce hook"]
    assert allreduce["steps"] == 2 and allreduce["sent"] == 2 * 4 * params  # two dense float32 steps
    adaalter, _ = results[0]["Local AdaAlter H=4"]
    # one period: 3 local steps and one averaging of parameters and accumulators
    assert adaalter["steps"] == 4 and adaalter["sent"] == 2 * 4 * params
    topk, _ = results[0]["top-k"]
    assert topk["sent"] < allreduce["sent"] / 4
    # one node of both ranks: each sends 0.1 of its half (to itself); dense is the whole gradient
    hierarchical, _ = results[0]["random-block, nodes of 2"]
    assert 0 < hierarchical["sent"] < hierarchical["dense"] / 10
    # PyTorch's averager: whole periods; its allreduces are on the wire, not in the hook's counter
    averager, _ = results[0]["HierarchicalModelAverager, nodes of 1 every step, all every 2"]
    assert averager["steps"] % 2 == 0 and averager["sent"] == 0 and averager["tx"] > 4 * params


def test_nodes_report_judges_each_target():
    import nodes_report

    block = dict(method="random_block", density=0.01, scope="layer", aggregation="allreduce")
    rows = []
    for bandwidth, seconds in (("100mbit", (6.0, 0.5, 0.4)), ("5mbit", (None, 3.0, 2.0))):
        flat_s, nodes_s = seconds[1], seconds[2]
        if seconds[0]:
            rows.append(_record("allreduce hook", "allreduce", seconds[0], bandwidth=bandwidth, nodes=2))
        rows.append(_record("random-block", "sparsify", flat_s, bandwidth=bandwidth, nodes=2,
                            slow_link_bytes_per_step=900.0, exchange_s=0.8 * flat_s - 0.01, **block))
        rows.append(_record("random-block, nodes of 2", "sparsify", nodes_s, bandwidth=bandwidth, nodes=2,
                            ranks_per_node=2, slow_link_bytes_per_step=400.0, exchange_s=0.1, **block))
    report = nodes_report.format_nodes_report(rows, None)
    assert "### resnet18 (11.17 M parameters), 2 nodes x 2 hosts, 5mbit between nodes" in report
    assert "0.44 of flat's 900 B (target 1/2: met)" in report
    assert "15.00x faster than the allreduce hook (target 10x: met)" in report
    assert "1.50x faster than flat random-block, whose exchange is 80% of its step (target 1.3x: met)" in report


# ----- a real cluster (root only) -----
def _can_make_namespaces() -> bool:
    if not sys.platform.startswith("linux") or os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")):
        return False
    probe = f"ddphb-probe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode == 0
    if made:
        subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    return made


_ECHO = ("import socket,sys\n"
         "s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('0.0.0.0', 5111));"
         " s.listen(1); c,_=s.accept(); c.sendall(c.recv(64)); c.close()\n")
_CALL = ("import socket,sys,time\n"
         "for _ in range(100):\n"
         "    try:\n        c=socket.create_connection((sys.argv[1], 5111), timeout=5); break\n"
         "    except OSError: time.sleep(0.05)\n"
         "c.sendall(b'ping'); print(c.recv(64).decode())\n")


@pytest.mark.skipif(not _can_make_namespaces(), reason="needs root, iproute2 and permission to create namespaces")
def test_real_cluster():
    def ours():
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
        names += [line.split(":")[1].strip().split("@")[0] for line in
                  subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout.splitlines()]
        return [n for n in names if cluster.owner_pid(n) == os.getpid()]

    with Cluster(2) as c:
        assert len(ours()) == 5  # 2 namespaces, 2 veth ends, the bridge
        routes = subprocess.run(["ip", "-n", c.namespace(0), "route"], capture_output=True, text=True).stdout
        assert routes.split()[:3] == ["10.213.0.0/24", "dev", "eth0"] and "default" not in routes
        c.set_rate("100mbit")
        qdisc = subprocess.run(["tc", "-n", c.namespace(1), "qdisc", "show", "dev", "eth0"], capture_output=True,
                               text=True).stdout
        assert "tbf" in qdisc and "100Mbit" in qdisc
        server = c.popen(1, [sys.executable, "-c", _ECHO])
        client = c.popen(0, [sys.executable, "-c", _CALL, c.address(1)], stdout=subprocess.PIPE, text=True)
        assert client.communicate(timeout=30)[0].strip() == "ping"
        assert server.wait(30) == 0
        sleeper = c.popen(0, ["sleep", "60"])
    assert sleeper.poll() is not None  # stopped by the teardown
    assert ours() == []


@pytest.mark.skipif(not _can_make_namespaces(), reason="needs root, iproute2 and permission to create namespaces")
def test_real_cluster_of_two_nodes_shapes_and_counts_the_link_between_them():
    with Cluster(2, nodes=2) as c:
        c.set_rate("100mbit")
        host_qdisc = subprocess.run(["tc", "-n", c.namespace(0), "qdisc", "show", "dev", "eth0"],
                                    capture_output=True, text=True).stdout
        uplink_qdisc = subprocess.run(["tc", "qdisc", "show", "dev", cluster.uplink_names(c.pid, 1)[0]],
                                      capture_output=True, text=True).stdout
        assert "tbf" not in host_qdisc and "tbf" in uplink_qdisc and "100Mbit" in uplink_qdisc
        before = c.uplink_bytes()
        server = c.popen(1, [sys.executable, "-c", _ECHO])
        client = c.popen(0, [sys.executable, "-c", _CALL, c.address(1)], stdout=subprocess.PIPE, text=True)
        assert client.communicate(timeout=30)[0].strip() == "ping"
        assert server.wait(30) == 0
        after = c.uplink_bytes()
        assert all(a > b for a, b in zip(after, before))  # each node sent its side of the conversation


_OWNER = ("import sys, time\n"
          "sys.path.insert(0, sys.argv[1])\n"
          "import cluster\n"
          "cluster.exit_on_signals()\n"
          "c = cluster.Cluster(2).open()\n"
          "sleeper = c.popen(0, ['sleep', '60'])\n"
          "print(sleeper.pid, flush=True)\n"
          "time.sleep(60)\n")


@pytest.mark.skipif(not _can_make_namespaces(), reason="needs root, iproute2 and permission to create namespaces")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_real_cluster_owner_killed(sig):
    """SIGTERM/SIGINT: the owner tears down (atexit); SIGKILL: its hosts die with it, remove_stale cleans up."""
    owner = subprocess.Popen([sys.executable, "-c", _OWNER, os.path.join(ROOT, "bench")], stdout=subprocess.PIPE,
                             text=True, start_new_session=True)
    try:
        sleeper = int(owner.stdout.readline())
        names = [cluster.ns_name(owner.pid, 0), cluster.ns_name(owner.pid, 1)]
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert all(n in listed for n in names)
        os.kill(owner.pid, sig)
        owner.wait(30)
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{sleeper}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{sleeper}")  # stopped by the teardown, or by PR_SET_PDEATHSIG
    if sig == signal.SIGKILL:
        assert sorted(n for n in cluster.remove_stale() if cluster.owner_pid(n) == owner.pid) == sorted(
            names + [cluster.bridge_name(owner.pid), cluster.veth_name(owner.pid, 0), cluster.veth_name(owner.pid, 1)])
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    left += subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert f"ddphb-{owner.pid}-" not in left and f"ddh{owner.pid}" not in left


def _bench_hooks_leave_gradients_local(rank, world_size):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    from comm_setup import build_exchange

    for method in (cluster_plan.NOOP, cluster_plan.BARRIER):
        torch.manual_seed(0)
        local = torch.nn.Linear(4, 3)
        model = DDP(torch.nn.Linear(4, 3))
        model.module.load_state_dict(local.state_dict())
        exchange = build_exchange(method.recipe_args())
        exchange.register(model)
        x = torch.full((2, 4), float(rank + 1))
        model(x).sum().backward()
        local(x).sum().backward()
        for mine, alone in zip(model.parameters(), local.parameters()):
            assert torch.equal(mine.grad, alone.grad), method.label  # not averaged: this rank's own gradient
        assert exchange.bytes_sent == (0 if method.hook == "noop" else 4)  # one bucket: one float


def test_the_ceiling_hooks_send_nothing_and_leave_each_rank_its_gradient():
    from ddp_hooks.testing import run_distributed

    run_distributed(_bench_hooks_leave_gradients_local, 2)

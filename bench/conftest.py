"""Benchmark summary: each row's minimum time as a multiple of the ``add_`` floor, timed between its rounds and as a row."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench helpers import each other


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    session = getattr(config, "_benchmarksession", None)
    groups = getattr(session, "groups", None) or []  # [(group, [benchmark as a flat dict])], set at session end
    rows = []
    for group, members in groups:
        floor = [b for b in members if b["name"].endswith("-floor]")]
        if not floor:
            continue
        base = floor[0]["min"]
        for b in sorted(members, key=lambda b: b["min"]):
            params = b["name"][b["name"].index("[") + 1:-1].split("-", 2)  # size, density[, row]
            label = params[2] if len(params) == 3 else b["name"].split("[")[0].replace("test_", "", 1)
            own = b["extra_info"].get("own_floor_min_s")
            rows.append((group, label, b["min"] * 1e3, "" if own is None else f"{b['min'] / own:.2f}",
                         b["min"] / base, b["extra_info"].get("bytes_sent", 0)))
    if not rows:
        return
    terminalreporter.write_sep("-", "minimum time over the add_ floor: timed between the row's rounds; the floor row")
    terminalreporter.write_line(f"{'group':<12} {'row':<34} {'min ms':>9} {'x floor':>8} {'x row':>7} "
                                f"{'bytes sent':>12}")
    for group, name, ms, own, ratio, sent in rows:
        terminalreporter.write_line(f"{group:<12} {name:<34} {ms:>9.3f} {own:>8} {ratio:>7.2f} {sent:>12}")

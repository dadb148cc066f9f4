"""Benchmark summary: each row's minimum time as a multiple of its group's ``floor`` row, same run."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench helpers import each other


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    session = getattr(config, "_benchmarksession", None)
    benchmarks = getattr(session, "benchmarks", None) or []
    groups = {}
    for bench in benchmarks:
        groups.setdefault(bench.group, []).append(bench)
    rows = []
    for group, members in sorted(groups.items(), key=lambda item: str(item[0])):
        floor = [b for b in members if b.name.startswith("test_floor_add")]
        if not floor:
            continue
        base = floor[0].stats.min
        for b in members:
            label = b.name.split("[")[0].replace("test_", "")
            params = b.name[len(label) + 6:].strip("[]")
            config = params.rsplit("-", 2)[0] if label == "hook" else label
            rows.append((group, config if label == "hook" else label, b.stats.min * 1e3, b.stats.min / base,
                         b.extra_info.get("bytes_sent", 0)))
    if not rows:
        return
    terminalreporter.write_sep("-", "minimum time over the add_ floor of the same group (this run)")
    terminalreporter.write_line(f"{'group':<12} {'row':<34} {'min ms':>9} {'x floor':>8} {'bytes sent':>12}")
    for group, name, ms, ratio, sent in rows:
        terminalreporter.write_line(f"{group:<12} {name:<34} {ms:>9.3f} {ratio:>8.2f} {sent:>12}")

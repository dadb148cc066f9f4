"""The tables of ``bench/bench_adaalter_convergence.py``: one row per method over seeds, the gap to
synchronous AdaGrad, and the largest period H within the issue's bound.

Run (through the benchmark)::

    python bench/bench_adaalter_convergence.py --report bench/results/adaalter-fmnist-w2.jsonl
"""

import json

from bench_fashion_mnist import cell


def family_and_period(name):
    """``("LAA rate outer", 16)`` for ``"LAA H=16 rate outer"``; ``(name, 0)`` for a row without a period."""
    head, _, tail = name.partition("H=")
    if not tail:
        return name, 0
    period, _, family = tail.partition(" ")
    return (head + family).strip(), int(period)


def row_order(name):
    """Sync AdaGrad first, then each family (in the benchmark's order) by growing H."""
    family, period = family_and_period(name)
    families = ["sync AdaGrad", "LAA paper", "LAA constant", "LAA rate", "LAA rate outer", "local SGD"]
    return (families.index(family) if family in families else len(families), family, period)


def table(results, task):
    """Markdown: one row per method, its metric, the gap to sync AdaGrad and the syncs per epoch."""
    by_name = {}
    for r in results:
        by_name.setdefault(r["name"], []).append(r)
    base = by_name.get("sync AdaGrad")
    base_mean = None if not base else sum(r["metric"] for r in base) / len(base)
    perplexity = task == "fortunes"
    metric = "val. perplexity" if perplexity else "test accuracy %"
    gap = "vs sync (%)" if perplexity else "vs sync (points)"
    sync_bytes = None if not base or "bytes_per_step" not in base[0] else \
        sum(r["bytes_per_step"] for r in base) / len(base)
    lines = [f"| method | {metric} | {gap} | syncs/epoch | bytes/step | x fewer |", "|---|---|---|---|---|---|"]
    for name, runs in sorted(by_name.items(), key=lambda item: row_order(item[0])):
        mean = sum(r["metric"] for r in runs) / len(runs)
        if base_mean is None or name == "sync AdaGrad":
            vs = ""
        elif perplexity:
            vs = f"{100.0 * (mean / base_mean - 1.0):+.2f}"
        else:
            vs = f"{mean - base_mean:+.2f}"
        syncs = sum(r["syncs_per_epoch"] for r in runs) / len(runs)
        bytes_per_step = sum(r.get("bytes_per_step", float("nan")) for r in runs) / len(runs)
        fewer = "" if sync_bytes is None or not bytes_per_step else f"{sync_bytes / bytes_per_step:.0f}"
        lines.append(f"| {name} | {cell(runs, 'metric', 3 if perplexity else 2)} | {vs} | {syncs:.1f} | "
                     f"{bytes_per_step:.0f} | {fewer} |")
    return "\n".join(lines)


def largest_periods(results, task):
    """Per family of runs (rule, with or without the outer optimizer): the largest H whose mean is within the
    issue's bound of sync AdaGrad's (1 point of accuracy; 2 % of perplexity), or None."""
    means = {}
    for r in results:
        means.setdefault(r["name"], []).append(r["metric"])
    means = {name: sum(v) / len(v) for name, v in means.items()}
    base = means.get("sync AdaGrad")
    if base is None:
        return {}
    within = (lambda m: m <= 1.02 * base) if task == "fortunes" else (lambda m: m >= base - 1.0)
    best, tried = {}, {}
    for name, mean in means.items():
        if not name.startswith(("LAA H=", "local SGD H=")):
            continue
        family, period = family_and_period(name)
        best.setdefault(family, None)
        tried[family] = max(tried.get(family, 0), period)
        if within(mean) and (best[family] is None or period > best[family]):
            best[family] = period
    return {family: (h, h == tried[family]) for family, h in best.items()}


def report(paths, merge=False):
    """Print each results file's command, header and table; with ``merge``, one table of all files, a
    later file's run replacing an earlier one of the same name and seed (a rerun of some rows)."""
    merged, task = {}, None
    for path in paths:
        with open(path) as f:
            first, *rest = [json.loads(line) for line in f if line.strip()]
        print(f"$ {first['command']}\n{first['header']}")
        task = first["task"]
        if merge:
            merged.update({(r["name"], r["seed"]): r for r in rest})
        else:
            print(summary(rest, task))
    if merge:
        print(summary(list(merged.values()), task))


def summary(results, task):
    bound = "2 % of perplexity" if task == "fortunes" else "1 point"
    largest = ", ".join(f"{family}: {'none' if h is None else f'H={h}'}{' (the largest tried)' if top else ''}"
                        for family, (h, top) in sorted(largest_periods(results, task).items(),
                                                       key=lambda item: row_order(item[0])))
    return f"\n{table(results, task)}\n\nLargest H within {bound} of sync AdaGrad: {largest}\n"

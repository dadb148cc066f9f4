"""Compare runs of train_cifar.py: accuracy vs epoch, accuracy vs bytes sent, time per step.

    python recipes/plot.py runs/allreduce/metrics.jsonl runs/sparsify/metrics.jsonl -o compare.png

Needs matplotlib (``pip install -e ".[plot]"``).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from run_metrics import read_metrics  # noqa: E402


def label_of(record: dict) -> str:
    """A run's default legend name: what tells runs of one hook apart (method and density, rank, period)."""
    hook, optimizer = record["hook"], record["optimizer"]
    if hook == "sparsify" and record.get("method") is not None:
        return f"{record['method']} d={record['density']:g}"
    if hook == "powersgd" and record.get("powersgd_rank") is not None:
        return f"powersgd rank {record['powersgd_rank']}"
    if optimizer == "local_adaalter" and record.get("period") is not None:
        return f"local_adaalter H={record['period']}"
    return f"{hook}/{optimizer}"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Plot metrics.jsonl files of train_cifar.py side by side.")
    p.add_argument("metrics", nargs="+", help="metrics.jsonl files, one per run")
    p.add_argument("--labels", nargs="+", default=None,
                   help="legend names, one per file (default: the method and density of a sparsify run, the rank "
                        "of a powersgd run, the period of a local_adaalter run, else hook/optimizer)")
    p.add_argument("-o", "--output", default="compare.png", help="image file to write (default: compare.png)")
    args = p.parse_args(argv)
    if args.labels is not None and len(args.labels) != len(args.metrics):
        p.error(f"{len(args.labels)} --labels for {len(args.metrics)} metrics files")
    return args


def main(args) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError as exc:
        raise SystemExit('plot.py needs matplotlib: pip install -e ".[plot]"') from exc
    fig, (acc, by_bytes, step_time) = plt.subplots(1, 3, figsize=(15, 4.5))
    for i, path in enumerate(args.metrics):
        records = read_metrics(path)
        if not records:
            raise SystemExit(f"{path}: no records")
        label = args.labels[i] if args.labels else label_of(records[0])
        epochs = [r["epoch"] for r in records]
        accuracy = [100 * r["test_accuracy"] for r in records]
        acc.plot(epochs, accuracy, marker="o", label=label)
        by_bytes.plot([r["bytes_sent_total"] / 1e6 for r in records], accuracy, marker="o", label=label)
        steps = [r["step"] - (records[j - 1]["step"] if j else 0) for j, r in enumerate(records)]
        step_time.plot(epochs, [1000 * r["time_epoch_s"] / n for r, n in zip(records, steps)], marker="o",
                       label=label)
    acc.set(xlabel="epoch", ylabel="test accuracy (%)", title="accuracy vs epoch")
    by_bytes.set(xlabel="MB sent per rank (payload, cumulative)", ylabel="test accuracy (%)",
                 title="accuracy vs bytes sent")
    step_time.set(xlabel="epoch", ylabel="ms per step (rank 0)", title="time per step")
    for ax in (acc, step_time):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs are whole numbers
    for ax in (acc, by_bytes, step_time):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(args.output, dpi=120)
    return args.output


if __name__ == "__main__":
    print(main(parse_args()))

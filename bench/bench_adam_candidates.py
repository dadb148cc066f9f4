"""Ways to feed Adam an error-fed sparse average, compared on Fashion-MNIST in one process (no DDP).

Run::

    python bench/bench_adam_candidates.py --seeds 2 --schedule cosine --out bench/results/adam-candidates-cosine.jsonl
    python bench/bench_adam_candidates.py --seeds 2 --schedule constant --out ...
    python bench/bench_adam_candidates.py --report FILE [FILE ...]

The task, data order and model are those of ``bench_fashion_mnist.py --part
adamw`` (the first 12,000 training images in ``--world`` shards, 32 images
per rank and step, 8 epochs, AdamW lr 1e-3, weight decay 0.01; its ``dense``
row is bit for bit that benchmark's). The ranks are simulated in one
process: each rank's gradient on its own batch, then random-block selection
(4-entry blocks, one draw shared by the ranks, per parameter tensor) with
the hook's density warm-up ``density ** (step / 1000)``, error feedback per
rank, and the average of the sent values. What differs is how the average
reaches Adam's two moments ``m`` and ``v``:

* ``dense``: AdamW on the dense average (the reference).
* ``error feedback``: AdamW on the sparse average, as ``sparsify_hook``
  gives it today.
* ``oracle v``: ``m`` fed the sparse average, ``v`` fed the square of the
  dense average: the second moment a dense step would have fed it. Not
  available to a real run (it needs the dense average).
* ``squares sent``: ``v`` fed the error-fed average of each rank's squared
  gradient, sent at the same positions (twice the values).
* ``rate v``: ``v`` fed ``rho B^2``, with ``B`` the average sent and ``rho``
  the tensor's sent fraction: a burst ``B`` carries about ``1/rho`` steps of
  gradient, each ``rho B`` (right where the gradient's mean dominates, ``rho``
  times too small where its noise does).
* ``momentum in sends``: Adam's first moment kept by each rank before the
  exchange (``u = b1 u + (1 - b1) g``, error feedback on ``u``), ``m`` set to
  the average of the sent ``u``, ``v`` as in ``rate v``: the Adam analogue of
  the hook's ``optimizer_momentum="sends"`` for SGD.
* ``smoothed``: the averages pass through a buffer ``P`` that releases
  ``rho P`` per step, so that Adam sees a steady stream instead of bursts.
* ``snr blocks``: today's feeding, but the blocks are drawn (still one draw
  for every rank) with probability rising with Adam's ``|m| / sqrt(v)`` in
  them, read from the optimizer's state, which every rank shares: the
  selection on the preconditioned gradient. A floor of the mean weight
  keeps every block in the draw.

Cells: final test accuracy, mean ± half range over seeds, gap to ``dense``.
"""

import argparse
import json
import math
import os
import shlex
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_fashion_mnist import cnn, cosine_lr, epoch_order, evaluate, load, rank_shard  # noqa: E402
from result_files import every_run, print_tables  # noqa: E402

CANDIDATES = ("dense", "error feedback", "oracle v", "squares sent", "rate v", "momentum in sends", "smoothed",
              "snr blocks")
BETA1, BETA2, EPS = 0.9, 0.999, 1e-8


def block_positions(numel: int, rho: float, block: int, generator: torch.Generator) -> torch.Tensor:
    """A random set of ``ceil(rho numel / block)`` whole blocks of ``block`` entries: their positions."""
    blocks = math.ceil(numel / block)
    chosen = torch.randperm(blocks, generator=generator)[:max(1, math.ceil(rho * numel / block))]
    positions = (chosen[:, None] * block + torch.arange(block)).flatten()
    return positions[positions < numel]


def snr_block_positions(numel, rho, block, generator, state):
    """``ceil(rho numel / block)`` blocks drawn without replacement, each with weight ``w + mean(w)``, ``w`` the
    block's mean of Adam's ``|m| / (sqrt(v) + eps)`` from the optimizer's ``state``: their positions."""
    snr = (state["exp_avg"].abs() / (state["exp_avg_sq"].sqrt() + EPS)).flatten()
    blocks = math.ceil(numel / block)
    padded = torch.zeros(blocks * block)
    padded[:numel] = snr
    weight = padded.view(blocks, block).mean(1)
    weight = weight + weight.mean() + 1e-12
    k = min(blocks, max(1, math.ceil(rho * numel / block)))
    chosen = torch.multinomial(weight, k, replacement=False, generator=generator)
    positions = (chosen[:, None] * block + torch.arange(block)).flatten()
    return positions[positions < numel]


def adamw_step(p, m, v, m_input, v_input, step, lr, weight_decay):
    """torch.optim.AdamW's step with separate inputs for its two moments (``m_input`` and ``v_input = g^2``;
    ``m_input=None``: ``m`` already holds its new value)."""
    if m_input is not None:
        m.mul_(BETA1).add_(m_input, alpha=1 - BETA1)
    v.mul_(BETA2).add_(v_input, alpha=1 - BETA2)
    denom = (v.sqrt() / math.sqrt(1 - BETA2 ** step)).add_(EPS)
    p.mul_(1 - lr * weight_decay)
    p.addcdiv_(m, denom, value=-lr / (1 - BETA1 ** step))


def train(candidate, data, args, seed):
    x_train, y_train, x_test, y_test = data
    shards = [rank_shard(x_train, y_train, r, args.world) for r in range(args.world)]
    steps_per_epoch = len(shards[0][1]) // args.batch
    total = args.epochs * steps_per_epoch
    model = cnn(seed)
    params = list(model.parameters())
    adamw = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    zeros = lambda: [torch.zeros_like(p) for p in params]  # noqa: E731
    residuals = [zeros() for _ in range(args.world)]
    square_residuals = [zeros() for _ in range(args.world)]
    velocities = [zeros() for _ in range(args.world)]
    m, v, pending = zeros(), zeros(), zeros()
    draws = torch.Generator().manual_seed(1234 + seed)
    step = 0
    for epoch in range(args.epochs):
        orders = [epoch_order(len(ys), seed, r, epoch) for r, (_, ys) in enumerate(shards)]
        for s in range(steps_per_epoch):
            lr = cosine_lr(args.lr, step, total) if args.schedule == "cosine" else args.lr
            rho = max(args.density, args.density ** (step / args.warmup)) if args.warmup else args.density
            grads = []
            for r, (xs, ys) in enumerate(shards):
                idx = orders[r][s * args.batch:(s + 1) * args.batch]
                model.zero_grad()
                F.cross_entropy(model(xs[idx]), ys[idx]).backward()
                grads.append([p.grad.detach().clone() for p in params])
            step += 1
            for i, p in enumerate(params):
                mean = sum(g[i] for g in grads) / args.world
                if candidate == "dense":
                    p.grad = mean
                    continue
                state = adamw.state.get(p, {})
                if candidate == "snr blocks" and "exp_avg" in state:
                    positions = snr_block_positions(p.numel(), rho, args.block, draws, state)
                else:
                    positions = block_positions(p.numel(), rho, args.block, draws)
                sent_fraction = positions.numel() / p.numel()

                def exchange(store, local):
                    average = torch.zeros(p.numel())
                    for r in range(args.world):
                        carried = store[r][i].flatten() + local(r)
                        average[positions] += carried[positions] / args.world
                        carried[positions] = 0.0
                        store[r][i] = carried.view_as(p)
                    return average.view_as(p)

                if candidate == "momentum in sends":
                    for r in range(args.world):
                        velocities[r][i].mul_(BETA1).add_(grads[r][i], alpha=1 - BETA1)
                    sent = exchange(residuals, lambda r: velocities[r][i].flatten())
                else:
                    sent = exchange(residuals, lambda r: grads[r][i].flatten())
                if candidate in ("error feedback", "snr blocks"):
                    p.grad = sent
                    continue
                if candidate == "smoothed":
                    pending[i] += sent
                    p.grad = pending[i] * sent_fraction
                    pending[i] -= p.grad
                    continue
                p.grad = None
                with torch.no_grad():
                    if candidate == "oracle v":
                        adamw_step(p, m[i], v[i], sent, mean ** 2, step, lr, args.weight_decay)
                    elif candidate == "squares sent":
                        squares = exchange(square_residuals, lambda r: grads[r][i].flatten() ** 2)
                        adamw_step(p, m[i], v[i], sent, squares, step, lr, args.weight_decay)
                    elif candidate == "rate v":
                        adamw_step(p, m[i], v[i], sent, sent_fraction * sent ** 2, step, lr, args.weight_decay)
                    elif candidate == "momentum in sends":  # m is the sent velocity itself: no second average
                        m[i].copy_(sent)
                        adamw_step(p, m[i], v[i], None, sent_fraction * sent ** 2, step, lr, args.weight_decay)
                    else:
                        raise ValueError(f"`candidate`={candidate!r} is not one of {CANDIDATES}")
            for group in adamw.param_groups:
                group["lr"] = lr
            adamw.step()  # the parameters whose .grad was set (dense, error feedback, smoothed)
    curve_end = evaluate(model, x_test, y_test)
    return {"seed": seed, "name": candidate, "accuracy": round(curve_end, 2)}


def table(results):
    dense = [r["accuracy"] for r in results if r["name"] == "dense"]
    base = sum(dense) / len(dense) if dense else None
    lines = ["| candidate | test accuracy % | gap to dense |", "|---|---|---|"]
    for name in CANDIDATES:
        values = [r["accuracy"] for r in results if r["name"] == name]
        if not values:
            continue
        mean = sum(values) / len(values)
        gap = "" if base is None or name == "dense" else f"{mean - base:+.2f}"
        lines.append(f"| {name} | {mean:.2f} ±{(max(values) - min(values)) / 2:.2f} | {gap} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", nargs="+", default=None, choices=CANDIDATES, help="these candidates (default all)")
    p.add_argument("--seeds", type=int, default=2, help="seeds 0..N-1 (default 2)")
    p.add_argument("--density", type=float, default=0.01, help="density after the warm-up (default 0.01)")
    p.add_argument("--warmup", type=int, default=1000, help="density warm-up steps, 0 for none (default 1000)")
    p.add_argument("--schedule", choices=("cosine", "constant"), default="cosine")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--train", type=int, default=12000)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--block", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--report", nargs="+", default=None, help="print the table of these results files and stop")
    args = p.parse_args(argv)
    if args.report:
        return print_tables(args.report, table)
    torch.set_num_threads(1)
    data = load(args)
    command = shlex.join(["python", "bench/bench_adam_candidates.py", *(argv if argv is not None else sys.argv[1:])])
    start = time.perf_counter()
    results = every_run(0, range(args.seeds), args.only or CANDIDATES, lambda name, seed: train(name, data, args, seed))
    print(f"\n$ {command}\n{time.perf_counter() - start:.0f} s\n\n{table(results)}")
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps({"command": command, "seconds": round(time.perf_counter() - start)}) + "\n")
            f.writelines(json.dumps(r) + "\n" for r in results)


if __name__ == "__main__":
    main()

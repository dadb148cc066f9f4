"""Memory held by the random selectors over the density warm-up: the process's resident size, step by step.

Run (about a minute)::

    python bench/bench_warmup_memory.py

One 25 MB bucket of 50 equal layers, layer scope, density 0.01 with the
default warm-up (density ``0.01 ** (s / 1000)`` at step ``s``), random-block
with 4-entry blocks (or ``--method randomk``): the positions of each of the
first ``--steps`` steps are chosen as the hook chooses them, and the
resident size is printed every 50 steps, with the plans the selector holds.
Before the selectors kept one plan per layout, an LRU of 256 (layout,
budgets) plans grew here by 2.2 GB by step 250 with random-block, and to
7.9 GB resident by step 500 with random-k (whose draws take over from
``randperm`` below density 1/4); with one plan per layout the resident size
stays within 0.3 GB of the start.
"""

import argparse

import torch

from ddp_hooks.sparsify import SparsifyOptions
from ddp_hooks.sparsify.selectors import Unit, budgets, draws, random_block

LAYERS = 50


def resident_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", choices=["random_block", "randomk"], default="random_block")
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(1)
    per_layer = 25 * 2**20 // 4 // LAYERS
    units = tuple(Unit(key, key * per_layer, per_layer) for key in range(LAYERS))
    options = SparsifyOptions(method=args.method, density=0.01)
    memo = random_block.block_plan if args.method == "random_block" else draws.draw_plan
    device = torch.device("cpu")
    print(f"{args.method}, 25 MB in {LAYERS} layers, density 0.01, density warm-up "
          f"{options.density_warmup_steps} steps; start: {resident_mb():.0f} MB resident")
    for step in range(args.steps):
        density = options.density_at(step)
        where = ([u.offset for u in units], [u.numel for u in units], budgets(units, density), [u.key for u in units])
        if args.method == "random_block":
            random_block.random_blocks(*where, block_size=options.block_size, seed=0, step=step, rank=-1,
                                       device=device)
        else:
            draws.random_subsets(*where, seed=0, step=step, rank=-1, device=device)
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  density {density:.3f}  resident {resident_mb():6.0f} MB  "
                  f"plans held {len(memo.held())}")


if __name__ == "__main__":
    main()

"""A small transformer language model under AdamW: every sparsifier's perplexity against dense, in unchanged user code.

Run::

    python bench/bench_fortunes_transformer.py --seeds 3 --out bench/results/fortunes-transformer-adamw.jsonl
    python bench/bench_fortunes_transformer.py --report bench/results/fortunes-transformer-adamw.jsonl
    python bench/bench_fortunes_transformer.py --quick        # a smoke run

Data: Debian's ``fortunes`` files (``apt-get install fortunes``; read by
``bench/fortunes_text.py``), characters as tokens. Each rank trains on its own
contiguous shard of the first ``--chars`` characters of the training text,
``--batch`` windows of ``--context`` characters per step, drawn at random
positions of its shard; the metric is the perplexity per character on the
first 65,536 characters of the validation text (every tenth fortune), in
windows of ``--context``.

Model: a decoder-only transformer (token and learned position embeddings,
``--layers`` pre-norm layers of ``torch.nn.TransformerEncoderLayer`` with a
causal mask, ``--width`` wide, 4 heads, feed-forward 4x, no dropout, a final
LayerNorm and a linear head). User code: ``torch.optim.AdamW(lr, weight_decay
=0.01)`` with a linear warm-up over the first 5 % of steps and a cosine decay,
gradient clipping at norm 1.0 (``--clip``; the Hugging Face Trainer's
defaults, but for the schedule's shape), and one added line, ``register_comm_hook(
SparsifyState(method=..., density=...), sparsify_hook)``, default options.
Dense is PyTorch's ``allreduce_hook`` in the same code.

Cells: validation perplexity, mean ± half range over seeds, and the gap to
dense in percent. The results (``--out``) hold every run, one JSON line each,
and start with the command that made them.
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
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ddp_hooks import SparsifyState, sparsify_hook  # noqa: E402
from ddp_hooks.testing import run_distributed  # noqa: E402
from fortunes_text import load_fortunes  # noqa: E402
from result_files import every_run, print_tables  # noqa: E402

METHODS = ("topk", "random_block", "randomk", "shared_topk")
VALIDATION_CHARS = 65536


class CharTransformer(torch.nn.Module):
    """A decoder-only transformer over characters: ``forward(ids) -> logits`` of shape ``(batch, time, vocab)``."""

    def __init__(self, vocab: int, width: int, layers: int, context: int):
        super().__init__()
        self.tokens = torch.nn.Embedding(vocab, width)
        self.positions = torch.nn.Embedding(context, width)
        layer = torch.nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.layers = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        x = self.tokens(ids) + self.positions(torch.arange(t, device=ids.device))
        x = self.layers(x, mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(x))


def learning_rate(peak: float, step: int, total: int) -> float:
    """Linear warm-up over the first 5 % of ``total`` steps, then cosine decay to 0."""
    warm = max(1, total // 20)
    if step < warm:
        return peak * (step + 1) / warm
    return peak * 0.5 * (1.0 + math.cos(math.pi * (step - warm) / (total - warm)))


def perplexity(model, ids: torch.Tensor, context: int) -> float:
    windows = ids[: (len(ids) - 1) // context * context + 1]
    x = windows[:-1].view(-1, context)
    y = windows[1:].view(-1, context)
    with torch.no_grad():
        total = sum(F.cross_entropy(model(x[i:i + 64]).flatten(0, 1), y[i:i + 64].flatten(), reduction="sum")
                    for i in range(0, len(x), 64))
    return math.exp(float(total) / y.numel())


def train_one(rank, world, data, run, args, seed):
    train_ids, valid_ids, vocab = data
    shard = len(train_ids) // world
    own = train_ids[rank * shard:(rank + 1) * shard]
    torch.manual_seed(seed)
    ddp = DDP(CharTransformer(vocab, args.width, args.layers, args.context))
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=0.01)
    state = None
    if run["method"] == "dense":
        ddp.register_comm_hook(None, allreduce_hook)
    else:
        state = SparsifyState(method=run["method"], density=run["density"], seed=seed,
                              **({"aggregation": "allgather"} if run["method"] == "topk" else {}))
        ddp.register_comm_hook(state, sparsify_hook)
    draws = torch.Generator().manual_seed(1000 * seed + rank)
    start, losses, curve = time.perf_counter(), [], []
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(args.lr, step, args.steps)
        at = torch.randint(0, shard - args.context - 1, (args.batch,), generator=draws)
        window = torch.stack([own[a:a + args.context + 1] for a in at.tolist()])
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(ddp(window[:, :-1]).flatten(0, 1), window[:, 1:].flatten())
        loss.backward()
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), args.clip)
        optimizer.step()
        losses.append(loss.item())
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            curve.append(round(perplexity(ddp.module, valid_ids, args.context), 4))
    return {"seed": seed, "name": run["name"], "perplexity": curve[-1], "curve": curve,
            "last_loss": sum(losses[-50:]) / len(losses[-50:]), "seconds": round(time.perf_counter() - start, 1),
            "parameters": sum(p.numel() for p in ddp.parameters()),
            "bytes_ratio": None if state is None else state.stats()["compression_ratio"]}


def body(rank, world, runs, args, seeds):
    torch.set_num_threads(1)
    train_ids, valid_ids, alphabet = load_fortunes(args.data_dir)
    data = (train_ids[:args.chars], valid_ids[:VALIDATION_CHARS], len(alphabet))
    return every_run(rank, seeds, runs, lambda run, seed: train_one(rank, world, data, run, args, seed))


def plan(densities):
    runs = [{"name": "dense", "method": "dense", "density": 1.0}]
    for d in densities:
        runs += [{"name": f"{m} d={d:g}", "method": m, "density": d} for m in METHODS]
    return runs


def table(results):
    dense = [r["perplexity"] for r in results if r["name"] == "dense"]
    base = sum(dense) / len(dense) if dense else None
    names = list(dict.fromkeys(r["name"] for r in results))
    lines = ["| run | validation perplexity | vs dense | bytes vs dense |", "|---|---|---|---|"]
    for name in names:
        rows = [r for r in results if r["name"] == name]
        values = [r["perplexity"] for r in rows]
        mean = sum(values) / len(values)
        gap = "" if base is None or name == "dense" else f"{100 * (mean / base - 1):+.2f} %"
        ratio = rows[0]["bytes_ratio"]
        lines.append(f"| {name} | {mean:.3f} ±{(max(values) - min(values)) / 2:.3f} | {gap} | "
                     f"{'' if ratio is None else f'1/{ratio:.1f}'} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--densities", type=float, nargs="+", default=[0.01])
    p.add_argument("--only", nargs="+", default=None, help="keep only the runs of these names")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--batch", type=int, default=16, help="windows per rank per step (default 16)")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--width", type=int, default=96)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--clip", type=float, default=1.0, help="gradient clipping norm, 0 for none (default 1.0)")
    p.add_argument("--chars", type=int, default=1 << 21, help="training characters used (default 2,097,152)")
    p.add_argument("--eval-every", type=int, default=500)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--quick", action="store_true", help="1 seed, 60 steps")
    p.add_argument("--out", default=None)
    p.add_argument("--report", nargs="+", default=None)
    args = p.parse_args(argv)
    if args.report:
        return print_tables(args.report, table)
    if args.quick:
        args.seeds, args.steps, args.eval_every = 1, 60, 30
    runs = plan(args.densities)
    if args.only:
        runs = [r for r in runs if r["name"] in args.only]
    seeds = list(range(args.seeds))
    given = argv if argv is not None else sys.argv[1:]
    command = shlex.join(["python", "bench/bench_fortunes_transformer.py", *given])
    start = time.perf_counter()
    results = run_distributed(body, args.world, runs, args, seeds, timeout=4 * 3600)[0]
    header = (f"fortunes, {args.chars} training characters in {args.world} shards; transformer {args.layers} x "
              f"{args.width}, context {args.context}; batch {args.batch}/rank, {args.steps} steps, AdamW lr {args.lr} "
              f"(5 % warm-up, cosine), weight decay 0.01, clipping {args.clip or 'none'}; seeds {seeds}; "
              f"{time.perf_counter() - start:.0f} s")
    print(f"\n$ {command}\n{header}\n\n{table(results)}")
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps({"command": command, "header": header}) + "\n")
            f.writelines(json.dumps(r) + "\n" for r in results)


if __name__ == "__main__":
    main()

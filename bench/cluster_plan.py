"""What the cluster benchmark measures: the methods, their options, and the full and quick plans.

A :class:`Method` is one row of the results: a DDP comm hook and an optimizer,
built by the CIFAR recipe's ``comm_setup`` (the same code, byte counters and
hook timer the recipe uses). A :class:`Run` is one model on one number of
hosts, measured at each bandwidth of its list.

Untimed steps before the first timed window of a method (always on the
unshaped network, see ``cluster_worker``): 2 for every method (DDP builds its
buckets in the first step and rebuilds them at the second); PowerSGD one more,
since it sends dense gradients for ``start_powerSGD_iter = 2`` steps and
compresses from the third; Local AdaAlter runs those 2 steps as its
synchronous warm-up. A timed window is at least ``steps`` steps and about
``min_window_s`` seconds; for Local AdaAlter whole periods of ``H`` steps
(``H - 1`` local steps and one that ends in the averaging).
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, field, replace
from typing import List, Optional, Sequence

from ddp_hooks.sparsify import SparsifyOptions

__all__ = ["Method", "Run", "sparsifier", "sparse_adaalter", "all_methods", "summary_methods", "headline_methods", "full_plan",
           "headline_plan",
           "quick_plan", "repeat", "BANDWIDTHS"]

BANDWIDTHS = ("unshaped", "1gbit", "100mbit")  # the order of measurement: warm-up runs unshaped
LR = 1e-3  # timing only; small, so that no run drifts into inf/NaN arithmetic


#: PyTorch's post-local SGD with its HierarchicalModelAverager (bench rows only: cluster_worker builds it)
HIERARCHICAL_AVERAGER = "hierarchical_averager"


@dataclass(frozen=True)
class Method:
    """One configuration: a hook (``comm_setup.HOOKS``) with its options, and an optimizer."""

    label: str
    hook: str
    optimizer: str = "sgd"
    method: Optional[str] = None  # sparsify: topk, randomk, random_block, shared_topk
    density: Optional[float] = None
    scope: Optional[str] = None
    aggregation: Optional[str] = None
    powersgd_rank: Optional[int] = None
    period: Optional[int] = None  # local_adaalter: H
    # the optimizer's momentum and weight decay (the sparsifier's momentum path costs work of its own)
    momentum: float = 0.0
    weight_decay: float = 0.0
    # sparsifiers, when trained (the time-to-accuracy curves): the density warm-up's steps, None for the default;
    # step times are always taken at a constant density
    density_warmup: Optional[int] = None
    density_warmup_start: Optional[float] = None  # where that warm-up starts (None: the default, 1)
    value_dtype: Optional[str] = None  # sparsifiers: the dtype values travel in (None: the gradient's)
    # Local AdaAlter: what a synchronisation sends (the recipe's --sync, --sync-density, --compress-accumulators)
    sync: str = "dense"
    sync_density: float = 0.01
    compress_accumulators: bool = False
    ranks_per_node: int = 0  # sparsifiers: dense inside nodes of this many ranks, sparse between (0: flat)

    @property
    def hook_warmup(self) -> int:
        """The hook's own dense warm-up (``--warmup-steps`` of the recipe)."""
        return {"powersgd": 2, "local_sgd": 2}.get(self.hook, 0)

    @property
    def untimed_steps(self) -> int:
        return 3 if self.hook == "powersgd" else 2

    @property
    def group_per_bucket(self) -> bool:
        """Whether each DDP bucket needs its own process group (``cluster_worker.PerBucketGroups``).

        PyTorch's PowerSGD hook launches its second and third collectives from
        future callbacks. On CUDA those run at once, in launch order; gloo
        completes work on its own threads, so with several buckets the ranks
        can launch them in different orders, and gloo matches collectives by
        launch order: the run fails with "Received data size doesn't match
        expected size". In a group of its own, each bucket's chain is ordered.
        """
        return self.hook == "powersgd"

    @property
    def step_multiple(self) -> int:
        """Timed windows are whole multiples of this many steps: a local method's period, else 1."""
        return self.period if self.optimizer in ("local_adaalter", HIERARCHICAL_AVERAGER) else 1

    def recipe_args(self) -> argparse.Namespace:
        """The recipe's flags for ``comm_setup.build_exchange`` and ``build_optimizer``."""
        return argparse.Namespace(
            hook=self.hook, method=self.method, density=self.density, scope=self.scope,
            aggregation=self.aggregation, no_error_feedback=False, warmup_steps=self.hook_warmup, hook_seed=0,
            powersgd_rank=self.powersgd_rank, optimizer=self.optimizer, lr=LR, momentum=self.momentum,
            weight_decay=self.weight_decay,
            eps={"adagrad": 1e-10, "local_adaalter": 1.0}.get(self.optimizer), period=self.period,
            lazy_correction=None, outer_lr=1.0, outer_momentum=0.0,  # Local AdaAlter's defaults
            # step times in the steady state: no density warm-up inside the timed windows
            block_size=SparsifyOptions.block_size, density_warmup_steps=0,  # random-block: the default blocks
            value_dtype=self.value_dtype, sync=self.sync, sync_density=self.sync_density, accumulator_period=0,
            compress_accumulators=self.compress_accumulators, nodes=self.ranks_per_node or None)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Run:
    """One model on ``hosts`` hosts, each method measured at each bandwidth (in round ``round``)."""

    hosts: int
    model: str
    methods: List[Method] = field(default_factory=list)
    bandwidths: Sequence[str] = BANDWIDTHS
    round: int = 0  # which repetition of the plan (--rounds)
    nodes: int = 1  # the cluster's nodes: hosts of a node share an unshaped bridge, shaped links between nodes


def sparsifier(method: str, density: float, scope: str, aggregation: str) -> Method:
    label = {"topk": "top-k", "randomk": "random-k", "random_block": "random-block", "shared_topk": "shared top-k"}[method]
    return Method(label, "sparsify", method=method, density=density, scope=scope, aggregation=aggregation)


ALLREDUCE = Method("allreduce hook", "allreduce")
# PyTorch's noop_hook: no gradient exchange at all, so its step time is the ceiling no hook can beat
NOOP = Method("noop hook (no exchange)", "noop")
# one 4-byte allreduce per bucket and no exchange: what keeping the ranks in step costs on its own
BARRIER = Method("4-byte allreduce per bucket", "barrier")
# the baseline measured once more at the end of a run: the gap shows how the machine's speed drifted meanwhile
ALLREDUCE_AGAIN = Method("allreduce hook, again", "allreduce")
FP16 = Method("fp16 hook", "fp16")
POWERSGD = {r: Method(f"PowerSGD rank {r}", "powersgd", powersgd_rank=r) for r in (1, 4)}
SYNC_ADAGRAD = Method("sync AdaGrad", "allreduce", optimizer="adagrad")
ADAALTER = {h: Method(f"Local AdaAlter H={h}", "local_sgd", optimizer="local_adaalter", period=h) for h in (4, 8)}


def sparse_adaalter(period: int, sync: str, density: float) -> Method:
    """Local AdaAlter whose synchronisations send pseudo-gradients and accumulators through ``sync`` at
    ``density``, error-fed (the recipe's ``--sync``, ``--sync-density``, ``--compress-accumulators``)."""
    label = {"random_block": "random-block", "shared_topk": "shared top-k"}.get(sync, sync)
    return Method(f"Local AdaAlter H={period}, {label} {density}", "local_sgd", optimizer="local_adaalter",
                  period=period, sync=sync, sync_density=density, compress_accumulators=True)


def all_methods() -> List[Method]:
    """Every configuration of issue 6: PyTorch's hooks, our sparsifiers, Local AdaAlter and its baseline;
    the allreduce hook first and again last; the noop hook (issue 21's ceiling)."""
    methods = [ALLREDUCE, NOOP, FP16, POWERSGD[1], POWERSGD[4]]
    for method in ("topk", "randomk", "random_block"):
        for density in (0.01, 0.1):
            for scope in ("layer", "bucket", "global"):
                for aggregation in ("allreduce", "allgather"):
                    if method == "topk" and aggregation == "allreduce":
                        continue  # refused: each rank's top-k positions differ
                    methods.append(sparsifier(method, density, scope, aggregation))
    return methods + [SYNC_ADAGRAD, ADAALTER[4], ADAALTER[8], ALLREDUCE_AGAIN]


def headline_methods() -> List[Method]:
    """The rows of the targets: allreduce hook, random-block at 0.01 (the defaults), PowerSGD rank 4, and the
    noop hook, the ceiling, and the 4-byte allreduce per bucket, the cost of synchronising alone."""
    return [ALLREDUCE, sparsifier("random_block", 0.01, "layer", "allreduce"), POWERSGD[4], NOOP, BARRIER]


def summary_methods() -> List[Method]:
    """One method of each kind: the allreduce hook first and again last, the two ceiling rows (noop, 4-byte
    allreduce), PyTorch's other hooks, top-k, random-k and random-block at 0.01 with their defaults (layer
    scope; top-k by AllGather), sync AdaGrad and Local AdaAlter H=4 and 8."""
    return [ALLREDUCE, NOOP, BARRIER, FP16, POWERSGD[1], POWERSGD[4],
            sparsifier("topk", 0.01, "layer", "allgather"), sparsifier("randomk", 0.01, "layer", "allreduce"),
            sparsifier("random_block", 0.01, "layer", "allreduce"), SYNC_ADAGRAD, ADAALTER[4], ADAALTER[8],
            ALLREDUCE_AGAIN]


def full_plan(hosts: Sequence[int] = (2, 4), models: Sequence[str] = ("resnet20", "resnet18"),
              bandwidths: Sequence[str] = BANDWIDTHS, methods: Optional[List[Method]] = None) -> List[Run]:
    """Every model on every host count at every bandwidth, with ``methods`` (default: :func:`all_methods`)."""
    methods = all_methods() if methods is None else methods
    return [Run(h, m, methods, tuple(bandwidths)) for h in hosts for m in models]


def headline_plan() -> List[Run]:
    """The rows of the targets only: ResNet-18 on 4 hosts, at 1 Gbit/s and 100 Mbit/s."""
    return [Run(4, "resnet18", headline_methods(), ("1gbit", "100mbit"))]


def repeat(runs: Sequence[Run], rounds: int) -> List[Run]:
    """The plan ``rounds`` times over, each copy numbered: round 0 of every run first, then round 1, ...

    Repeating the whole plan, rather than each measurement in place, spreads
    a method's measurements over the run, so a slow spell of the machine hits
    one of them, not all.
    """
    return [replace(run, round=k) for k in range(rounds) for run in runs]


def quick_plan() -> List[Run]:
    """Under 3 minutes: the small model with one of each kind on 2 and 4 hosts, ResNet-18's headline rows
    on 4 hosts; 1 Gbit/s and 100 Mbit/s only."""
    small = [ALLREDUCE, NOOP, FP16, POWERSGD[1], sparsifier("topk", 0.01, "layer", "allgather"),
             sparsifier("randomk", 0.01, "layer", "allreduce"), sparsifier("random_block", 0.01, "layer", "allreduce"),
             SYNC_ADAGRAD, ADAALTER[4]]
    shaped = ("1gbit", "100mbit")
    return [Run(2, "resnet20", small, shaped), Run(4, "resnet20", small, shaped)] + headline_plan()


def hierarchical_averager(period: int, ranks_per_node: int) -> Method:
    """PyTorch's local SGD with ``HierarchicalModelAverager``: the weights averaged inside each node every step
    and over every rank every ``period`` steps (no gradient traffic once the hook's warm-up is over)."""
    return Method(f"HierarchicalModelAverager, nodes of {ranks_per_node} every step, all every {period}", "local_sgd",
                  optimizer=HIERARCHICAL_AVERAGER, period=period, ranks_per_node=ranks_per_node)


def in_nodes(method: Method, ranks_per_node: int) -> Method:
    """``method`` dense inside nodes of ``ranks_per_node`` hosts and sparse between them."""
    return replace(method, label=f"{method.label}, nodes of {ranks_per_node}", ranks_per_node=ranks_per_node)


def nodes_plan() -> List[Run]:
    """Dense inside nodes, sparse between: ResNet-18 on 2 nodes of 2 hosts against the flat exchange and
    PyTorch's hooks at 100 Mbit/s between nodes, the sparsifiers alone at 10, 5 and 2 Mbit/s (where the flat
    exchange's time dominates the step), and on 2 nodes of 4 hosts at 1 Gbit/s (bytes on the slow link)."""
    flat_block = sparsifier("random_block", 0.01, "layer", "allreduce")
    flat_shared = sparsifier("shared_topk", 0.01, "layer", "allreduce")

    def sparse(ranks_per_node):
        return [flat_block, in_nodes(flat_block, ranks_per_node), flat_shared, in_nodes(flat_shared, ranks_per_node)]

    return [Run(4, "resnet18", [ALLREDUCE, NOOP, POWERSGD[4], hierarchical_averager(8, 2)] + sparse(2), ("100mbit",),
                nodes=2),
            Run(4, "resnet18", sparse(2), ("10mbit", "5mbit", "2mbit"), nodes=2),
            Run(8, "resnet18", sparse(4), ("1gbit",), nodes=2)]


def shared_topk_plan() -> List[Run]:
    """Issue 18: shared top-k against top-k (AllGather), random-block and the allreduce hook, on 4 hosts,
    both models, at 1 Gbit/s and 100 Mbit/s."""
    methods = [ALLREDUCE]
    for density in (0.01, 0.05):
        methods += [sparsifier("topk", density, "layer", "allgather"),
                    sparsifier("shared_topk", density, "layer", "allreduce")]
    methods += [sparsifier("random_block", 0.01, "layer", "allreduce"), ALLREDUCE_AGAIN]
    return [Run(4, model, methods, ("1gbit", "100mbit")) for model in ("resnet20", "resnet18")]

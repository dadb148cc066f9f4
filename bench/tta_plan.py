"""What the time-to-accuracy benchmark trains and times: methods, their training settings, the density grid.

Every method trains ``fmnist-cnn`` (:data:`MODEL`; or ``fmnist-resnet20``, ``bench_models``) on Fashion-MNIST through
the CIFAR recipe's ``comm_setup`` (the hooks, optimizers and byte counters the
recipe uses) at its recommended settings: the sparsifiers with their default
options (density warm-up included), PowerSGD as PyTorch ships it, Local
AdaAlter with the recipe's defaults. Two optimizer families:

* SGD: ``lr 0.05`` with cosine decay to 0 over the run, momentum 0.9, weight
  decay 5e-4 (the Fashion-MNIST convergence benchmark's user code);
* AdaGrad: ``lr 0.1, eps 1.0`` at a constant rate, no weight decay (the
  Local AdaAlter benchmark's Fashion-MNIST settings, chosen there by a sweep).

A sparsifier's step time depends on the density it sends at, and the default
density warm-up sends more early on (``density ** (s / 1000)`` at step ``s``,
from 1 down to the target over 1000 steps). The cluster therefore times each
selector at every density of :data:`DENSITY_GRID` down to its target, and the
report integrates the step time over the warm-up (``tta_report``).

    >>> [m.label for m in curve_methods(quick=True)]
    ['allreduce hook', 'random-block d=0.01']
    >>> len(step_time_methods(curve_methods())), training_args(ADAGRAD_METHODS[0]).eps
    (44, 1.0)
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import List

from cluster_plan import ADAALTER, ALLREDUCE, FP16, NOOP, POWERSGD, SYNC_ADAGRAD, Method, Run, sparsifier

from ddp_hooks.sparsify import SparsifyOptions

__all__ = ["MODEL", "HOSTS", "BANDWIDTHS", "DENSITY_GRID", "SGD", "ADAGRAD", "ADAGRAD_METHODS", "curve_methods",
           "step_time_methods", "step_time_plan", "training_args", "learning_rate", "method_key", "warmup_variants",
           "value_dtype_variants", "warmup_candidates", "with_values", "sparsify_options"]

MODEL = "fmnist-cnn"
HOSTS = 4
BANDWIDTHS = ("1gbit", "100mbit")
#: densities at which the cluster times each selector (down to the method's own density). The top is 0.99,
#: not 1: at exactly 1 every unit is sent whole and in order, which took random-block about half the work of
#: 0.9999 (fmnist-cnn, 2 ranks: 54 against 96 ms per step), while the warm-up is below 1 from its second step on.
#: 0.2 lies just below 1/4, where top-k under AllGather at 4 hosts turns to sending everything by AllReduce
#: (``ddp_hooks.sparsify.compressor.gather_outweighs_allreduce``; the report interpolates on each side apart).
DENSITY_GRID = (0.99, 0.3, 0.2, 0.1, 0.05, 0.01)
SGD = {"lr": 0.05, "momentum": 0.9, "weight_decay": 5e-4, "eps": None, "schedule": "cosine"}
ADAGRAD = {"lr": 0.1, "momentum": 0.0, "weight_decay": 0.0, "eps": 1.0, "schedule": "constant"}
ADAGRAD_METHODS = (SYNC_ADAGRAD, ADAALTER[4], ADAALTER[8])


def _sparsifiers(density: float) -> List[Method]:
    return [sparsifier("topk", density, "layer", "allgather"), sparsifier("randomk", density, "layer", "allreduce"),
            sparsifier("random_block", density, "layer", "allreduce"),
            sparsifier("shared_topk", density, "layer", "allreduce")]


def _labelled(method: Method) -> Method:
    """Sparsifiers carry their density in the label (one curve each)."""
    return replace(method, label=f"{method.label} d={method.density:g}") if method.hook == "sparsify" else method


def warmup_variants() -> List[Method]:
    """Random-block d=0.01 with a shorter density warm-up than the default 1000 steps, and with none, and shared
    top-k d=0.01 with none: what the warm-up's time buys in accuracy."""
    block = _labelled(sparsifier("random_block", 0.01, "layer", "allreduce"))
    shared = _labelled(sparsifier("shared_topk", 0.01, "layer", "allreduce"))
    return [replace(block, label=f"{block.label} warm-up {steps}", density_warmup=steps) for steps in (250, 0)] + [
        replace(shared, label=f"{shared.label} warm-up 0", density_warmup=0)]


def warmup_candidates() -> List[Method]:
    """Shared top-k and top-k with other density warm-ups than the default (1000 steps from density 1): the
    candidates for a cheaper one. Not in :func:`curve_methods`; ``--only`` picks them by label."""
    def variant(method, steps, start):
        return replace(method, label=f"{method.label} warm-up {steps} from {start:g}", density_warmup=steps,
                       density_warmup_start=start)

    shared = {(d, dtype): with_values(_labelled(sparsifier("shared_topk", d, "layer", "allreduce")), dtype)
              for d in (0.01, 0.05) for dtype in (None, "float16")}
    low = shared[0.01, None]
    return ([variant(method, 1000, 0.1) for method in shared.values()]
            + [variant(_labelled(sparsifier("topk", 0.01, "layer", "allgather")), 1000, 0.1)]
            + [variant(low, steps, 1.0) for steps in (100, 300)]
            + [variant(low, steps, 0.1) for steps in (300, 500)]
            + [variant(low, 300, 0.25), variant(low, 1000, 0.05)])


def value_dtype_variants() -> List[Method]:
    """Random-block and shared top-k with their values sent as float16 (``value_dtype``; the rounding stays in
    the residual): half the values' bytes of every step, the density warm-up's dense early steps included."""
    return [with_values(_labelled(sparsifier(name, d, "layer", "allreduce")), "float16")
            for name in ("random_block", "shared_topk") for d in (0.01, 0.05)]


def with_values(method: Method, value_dtype) -> Method:
    """``method`` with its values sent as ``value_dtype`` (``None``: unchanged), labelled so."""
    if value_dtype is None:
        return method
    return replace(method, label=f"{method.label} {value_dtype} values", value_dtype=value_dtype)


def curve_methods(quick: bool = False) -> List[Method]:
    """The methods trained to a curve (the noop hook trains nothing useful and is timed only)."""
    if quick:
        return [ALLREDUCE, _labelled(sparsifier("random_block", 0.01, "layer", "allreduce"))]
    methods = [ALLREDUCE, FP16, POWERSGD[4], POWERSGD[1]]
    methods += [_labelled(m) for d in (0.01, 0.05) for m in _sparsifiers(d)]
    return methods + list(ADAGRAD_METHODS) + warmup_variants() + value_dtype_variants()


def method_key(method: Method) -> str:
    """What a method's step times are filed under: the selector and its values' dtype (timed over the density
    grid), else the label."""
    if method.hook != "sparsify":
        return method.label
    return f"sparsify {method.method} {method.aggregation}" + (f" {method.value_dtype}" if method.value_dtype else "")


def _as_trained(method: Method) -> Method:
    """``method`` with its family's momentum and weight decay, which the sparsifier's work depends on."""
    family = ADAGRAD if method.optimizer in ("adagrad", "local_adaalter") else SGD
    return replace(method, momentum=family["momentum"], weight_decay=family["weight_decay"])


def step_time_methods(curves: List[Method]) -> List[Method]:
    """The cluster's rows: the noop hook (the ceiling), every non-sparsifier of ``curves``, and each selector of
    ``curves`` at every density of the grid down to the lowest it is trained at (no density warm-up); each with
    its family's momentum and weight decay (the noop hook: SGD's)."""
    return [_as_trained(m) for m in _step_time_rows(curves)]


def _step_time_rows(curves: List[Method]) -> List[Method]:
    """Each selector over the grid from the lowest density it trains at up to the first grid density at or above
    the highest it reaches in a density warm-up."""
    rows, lowest, highest = [NOOP], {}, {}
    for m in curves:
        if m.hook != "sparsify":
            rows.append(m)
            continue
        key = (m.method, m.aggregation, m.value_dtype)
        options = sparsify_options(m)
        lowest[key] = min(lowest.get(key, 1.0), m.density)
        highest[key] = max(highest.get(key, 0.0), options.density_at(options.warmup_steps))
    for key, low in lowest.items():
        name, aggregation, value_dtype = key
        ceiling = min((d for d in DENSITY_GRID if d >= highest[key] - 1e-12), default=max(DENSITY_GRID))
        rows += [with_values(sparsifier(name, d, "layer", aggregation), value_dtype)
                 for d in DENSITY_GRID if low - 1e-12 <= d <= ceiling]
    return rows


def sparsify_options(method: Method) -> SparsifyOptions:
    """The hook options a sparsifier of the plan trains with (its density warm-up's steps and start: None, the
    defaults)."""
    return SparsifyOptions(method=method.method, density=method.density, aggregation=method.aggregation,
                           density_warmup_steps=method.density_warmup,
                           density_warmup_start=method.density_warmup_start, value_dtype=method.value_dtype)


def step_time_plan(curves: List[Method], rounds: int = 1, model: str = MODEL) -> List[Run]:
    """The cluster plan: :data:`HOSTS` hosts, ``model`` (default :data:`MODEL`), the rows of
    :func:`step_time_methods`, each round measuring every row at 1 Gbit/s, then 100 Mbit/s."""
    rows = step_time_methods(curves)
    return [Run(HOSTS, model, rows, BANDWIDTHS, round=k) for k in range(rounds)]


def training_args(method: Method):
    """The recipe's flags (``comm_setup``) for training ``method``: its family's settings, default options."""
    family = ADAGRAD if method.optimizer in ("adagrad", "local_adaalter") else SGD
    args = method.recipe_args()
    args.lr, args.momentum, args.weight_decay = family["lr"], family["momentum"], family["weight_decay"]
    args.eps = family["eps"]
    args.density_warmup_steps = method.density_warmup  # None: the default (recipe_args turns it off)
    args.density_warmup_start = method.density_warmup_start
    return args


def learning_rate(method: Method, step: int, total_steps: int) -> float:
    """The learning rate of ``step`` of ``total_steps``: cosine decay to 0 for SGD, constant for AdaGrad."""
    if method.optimizer in ("adagrad", "local_adaalter"):
        return ADAGRAD["lr"]
    return SGD["lr"] * 0.5 * (1.0 + math.cos(math.pi * step / total_steps))

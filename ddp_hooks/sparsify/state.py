"""The state of the sparsifying hook, by lifetime: options; what each rank keeps from step to step
and saves (:mod:`.checkpoint`); what the first hook call binds; one backward pass (the hook's
``StepRun``); caches (:mod:`.memory`).
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Dict, NamedTuple, Optional, Union

import torch
import torch.distributed as dist

from .._internal.collectives import check_same_on_all_ranks
from .._internal.validation import check_group_ready, check_process_group
from ..stats import CommStats
from . import checkpoint
from .compressor import SparseCompressor
from .memory import BucketLayouts, LastUpdates, Layout, NonfiniteSteps, ResidualStore, SparseOutputs
from .nodes import Nodes, NodeSpec, Shardings, check_node_spec, node_groups, node_ranks, nodes_code
from .momenta import OptimizerMomenta, refresh_momenta, velocity_momentum, velocity_runs, watch_first_step
from .options import OPTION_NAMES, SparsifyOptions

__all__ = ["SparsifyState", "Binding"]

logger = logging.getLogger(__name__)


class Binding(NamedTuple):
    """What the first hook call binds: the process group, this rank, and the world size."""

    group: Any
    rank: int
    world_size: int
    nodes: Optional[Nodes] = None  # with SparsifyState(nodes=...): the node's and the cross-node group


class SparsifyState:
    r"""State of :func:`~ddp_hooks.sparsify_hook`: options, residuals, step counter, stats.

    Every argument is checked here, before anything touches
    ``torch.distributed``, so a bad configuration fails at once.

    Args:
        process_group: the group to communicate in; ``None`` is the default group.
        method (str): the selector: ``"random_block"`` (default), ``"topk"``, ``"randomk"``, ``"shared_topk"``.
        density (float): fraction of entries sent per unit, in (0, 1] (0.01).
        scope (str): the unit with its own budget: ``"layer"`` (default), ``"bucket"``, ``"global"``.
        aggregation (str): ``"allreduce"`` (default; shared positions) or ``"allgather"``.
        error_feedback (bool): keep what was not sent and add it next step (True).
        warmup_steps (int): plain allreduce for the first ``warmup_steps`` steps (0).
        density_warmup_steps (int): steps over which the density falls to ``density`` (``None``: 1000).
        density_warmup_start (float): the density the warm-up falls from, in (0, 1] (``None``: 1).
        seed (int): seed of the random selectors (0).
        block_size (int): ``random_block``'s entries per block (4).
        momentum, weight_decay (float): the hook's own momentum and weight decay (0, 0).
        optimizer_momentum (str): ``"auto"`` (default), ``"sends"`` or ``"steps"``.
        error_feedback_beta (float): a low-pass filter on the residual, in (0, 1] (1: none).
        value_dtype (str): the dtype values travel in: ``None`` (the gradient's), ``"float16"``,
            ``"bfloat16"``, ``"float32"``; the rounding stays in the residual.
        nodes: ``None`` (default): every rank exchanges sparsely with every
            other. Else the ranks form nodes, dense inside a node and sparse
            between nodes (:mod:`~ddp_hooks.sparsify.nodes`): ``"local"``
            (``LOCAL_WORLD_SIZE`` consecutive ranks per node, as torchrun
            starts them), an int (ranks per node), or the ranks of each
            node. Each rank then sends and keeps residuals for ``1 / L`` of
            the gradient (``L`` ranks per node).
        grad_scaler (torch.amp.GradScaler): the scaler of an AMP run, or
            ``None``. Gradients reach the hook multiplied by the loss scale
            ``S``, which the scaler changes between steps; with the scaler
            given, the per-rank states are kept unscaled (``e`` in gradient
            units, ``p = g + S * e``), so a change of ``S`` cannot leave a
            stale factor ``S_new / S_old`` in them. Without it they hold
            scaled values: fine without AMP or with a constant scale. The
            scaler is not part of :meth:`state_dict` or of a pickle: give it
            again when resuming.

    The options other than the process group and the scaler are explained,
    with why each exists, in :class:`~ddp_hooks.sparsify.options.SparsifyOptions`
    (``state.options``); each is also a read-only attribute (``state.density``).

    Non-finite gradients (an AMP overflow, a NaN): when any rank's gradient
    holds inf or NaN at a step, every rank's output for that step is made
    non-finite (so ``GradScaler`` skips the step on every rank, as with a
    dense allreduce), and every rank's residuals keep their values from
    before the step: the step's gradient is discarded as a skipped step
    discards a dense one. The step counter still advances on every rank alike.
    ``stats()["nonfinite_steps"]`` counts such steps.

    The error-feedback and momentum recursions, with their invariants, are in
    :mod:`ddp_hooks.sparsify.compressor`.

    Example::

        >>> from ddp_hooks import SparsifyState
        >>> state = SparsifyState(method="random_block", density=0.01)
        >>> state.step
        0
        >>> SparsifyState(method="topk", aggregation="allreduce")
        Traceback (most recent call last):
        ...
        ValueError: `aggregation`='allreduce' cannot be used with `method`='topk': ...
    """

    __slots__ = (
        "options", "process_group", "grad_scaler",
        # kept across steps and checkpoints; `step` advances once per backward, on the last bucket
        "step", "compressor", "last_updates", "momenta", "counters", "nonfinite",
        # bound at the first hook call; the layouts of the buckets met; a loaded checkpoint's rank and keys
        "nodes", "binding", "layouts", "loaded", "shardings",
        # one backward pass (None between them), and the result vectors
        "run", "results",
        # the optimizer check installed at the first hook call holds only a weak reference
        "__weakref__",
    )

    def __init__(
        self,
        process_group: Optional[dist.ProcessGroup] = None,
        method: str = "random_block",
        density: float = 0.01,
        scope: str = "layer",
        aggregation: str = "allreduce",
        error_feedback: bool = True,
        warmup_steps: int = 0,
        seed: int = 0,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        grad_scaler: Optional["torch.amp.GradScaler"] = None,
        block_size: int = 4,
        optimizer_momentum: str = "auto",
        density_warmup_steps: Optional[int] = None,
        error_feedback_beta: float = 1.0,
        value_dtype: Optional[Union[str, torch.dtype]] = None,
        nodes: NodeSpec = None,
        density_warmup_start: Optional[float] = None,
    ) -> None:
        check_process_group("process_group", process_group)
        self.nodes = check_node_spec(nodes)
        if grad_scaler is not None and not isinstance(grad_scaler, torch.amp.GradScaler):
            raise TypeError(f"`grad_scaler` must be None or a torch.amp.GradScaler, got {type(grad_scaler).__name__}; "
                            "the hook reads the loss scale from it to keep the residuals unscaled")
        self.options = SparsifyOptions(
            method=method, density=density, scope=scope, aggregation=aggregation, error_feedback=error_feedback,
            warmup_steps=warmup_steps, seed=seed, momentum=momentum, weight_decay=weight_decay,
            block_size=block_size, optimizer_momentum=optimizer_momentum, density_warmup_steps=density_warmup_steps,
            density_warmup_start=density_warmup_start, error_feedback_beta=error_feedback_beta, value_dtype=value_dtype)
        if self.options.density == 1.0:
            warnings.warn("SparsifyState: density=1 sends every entry; the hook then costs a plain allreduce "
                          "plus bookkeeping", stacklevel=2)
        self.process_group = process_group
        self.grad_scaler = grad_scaler
        self.step = 0
        self.counters = CommStats()
        self.compressor = SparseCompressor(self.options, self.counters)  # holds the residuals and velocities
        self.last_updates = LastUpdates()
        self.momenta = OptimizerMomenta()
        self.nonfinite = NonfiniteSteps()
        self.binding: Optional[Binding] = None
        self.layouts = BucketLayouts()
        self.loaded: Optional[checkpoint.Loaded] = None
        self.run = None  # the hook's StepRun during a backward pass
        self.results = SparseOutputs()  # per bucket, the result vector kept at zero (CPU, float32)
        self.shardings = Shardings()  # with nodes: how each bucket is cut into shards

    # ----- what the compressor keeps -----
    @property
    def residuals(self) -> ResidualStore:
        """This rank's error-feedback residuals, per parameter key (the compressor's)."""
        return self.compressor.residuals

    @property
    def velocities(self) -> ResidualStore:
        """This rank's momentum velocities, per parameter key (the compressor's)."""
        return self.compressor.velocities

    # ----- what the options imply -----
    @property
    def selector(self):
        """The coordinate selector (:mod:`ddp_hooks.sparsify.selectors`)."""
        return self.options.selector

    @property
    def counts_momentum_in_sends(self) -> bool:
        """True when the optimizer's momentum is counted in sends (``optimizer_momentum``, resolved)."""
        return self.options.counts_momentum_in_sends

    def density_at(self, step: int) -> float:
        """The density of step ``step`` (:meth:`SparsifyOptions.density_at`)."""
        return self.options.density_at(step)

    @property
    def runs_velocity(self) -> bool:
        """True while the hook keeps a velocity (:func:`ddp_hooks.sparsify.momenta.velocity_runs`)."""
        return velocity_runs(self.options, self.momenta)

    def send_momentum(self, layout: Layout, device: torch.device):
        """The momentum the velocity steps with in a bucket (:func:`ddp_hooks.sparsify.momenta.velocity_momentum`)."""
        return velocity_momentum(self.options, self.momenta, layout, device)

    def refresh_momenta(self) -> None:
        """Read each parameter's momentum from the optimizers seen (:mod:`ddp_hooks.sparsify.momenta`)."""
        refresh_momenta(self)

    # ----- per parameter -----
    def residual_for(self, param: torch.Tensor) -> torch.Tensor:
        """A copy of this rank's error-feedback residual of ``param``, shaped like it (zeros if it has none).

        With ``nodes``, this rank's piece of it, flat (:mod:`~ddp_hooks.sparsify.nodes`).
        """
        return self._state_of(self.residuals, param)

    def velocity_for(self, param: torch.Tensor) -> torch.Tensor:
        """A copy of this rank's momentum velocity of ``param``, shaped like it (zeros if it has none)."""
        return self._state_of(self.velocities, param)

    def _state_of(self, store: ResidualStore, param: torch.Tensor) -> torch.Tensor:
        key = self.layouts.key_of(param)
        found = None if key is None else store.of_key(key)
        if found is None:
            return torch.zeros(param.shape)
        return found.reshape(param.shape) if found.numel() == param.numel() else found  # (with nodes: a piece)

    # ----- binding to the process group, at the first hook call -----
    def bind(self, bucket: dist.GradBucket) -> None:
        """At the first hook call: the group, rank and world size; the options agreed by every rank."""
        if self.binding is not None:
            return
        device = bucket.buffer().device
        group = check_group_ready(self.process_group, device, "sparsify_hook")
        world_size = dist.get_world_size(group)
        # one small allgather at the first step: every rank fails alike on a mismatch
        settings = {**self.options.config_ints(), "grad_scaler": int(self.grad_scaler is not None),
                    "ranks_per_node": 0 if self.nodes is None else len(node_ranks(self.nodes, world_size)[0]),
                    "node_ranks": 0 if self.nodes is None else nodes_code(node_ranks(self.nodes, world_size))}

        def describe(s):
            nodes = "None (flat)" if not s["ranks_per_node"] else \
                f"{s['ranks_per_node']} ranks per node (their lists' code {s['node_ranks']})"
            return (f"{self.options.describe(s)}, grad_scaler={'given' if s['grad_scaler'] else 'None'}, "
                    f"nodes={nodes}")

        check_same_on_all_ranks(settings, group, world_size, device, "SparsifyState options",
                                "every rank must select and aggregate alike", describe)
        nodes = None if self.nodes is None else node_groups(self.nodes, group)
        self.binding = Binding(group=group, rank=dist.get_rank(group), world_size=world_size, nodes=nodes)
        checkpoint.check_loaded_rank(self)
        watch_first_step(self)
        if self.binding.rank == 0:
            logger.info("sparsify_hook: %s on %d ranks", self.options.describe(self.options.config_ints()),
                        self.binding.world_size)

    # ----- public API -----
    def stats(self) -> Dict[str, float]:
        """Counts since the start: steps, elements and bytes sent vs dense, their ratio, discarded steps.

        ``nonfinite_steps`` counts the compressed steps whose gradient held
        inf or NaN on some rank (reading it waits for the device on CUDA).
        """
        return {**self.counters.as_dict(), "nonfinite_steps": int(self.nonfinite)}

    def state_dict(self) -> Dict[str, Any]:
        """Step, residuals and velocities (this rank's), counters and options; tensors and ints only.

        Loads with ``torch.load(..., weights_only=True)``. Residuals differ per
        rank: every rank saves and loads its own.
        """
        return checkpoint.state_dict_of(self)

    def load_state_dict(self, state_dict: Dict[str, Any], residuals: bool = True) -> None:
        """Restore a :meth:`state_dict` saved by this rank with the same options.

        Refused with ``ValueError``: other options (method, density, scope,
        aggregation, error feedback, warm-up, seed, momentum, weight decay),
        and, at the first step, another world size, another rank or another
        model's residuals. With ``residuals=False`` the residuals and
        velocities are dropped (they restart at 0) and the world size may
        differ; the step and counters are kept. A state saved before the
        ``momentum`` option existed loads as ``momentum=0, weight_decay=0``.
        """
        checkpoint.load_into(self, state_dict, residuals=residuals)

    def __getstate__(self):
        """Pickle support, as PyTorch's PowerSGDState: the process group is not serialisable and is dropped."""
        logger.warning("SparsifyState: the process group is not serialisable and is excluded from the pickle")
        return {"options": self.options.as_kwargs(), "nodes": self.nodes, "state": self.state_dict()}

    def __setstate__(self, blob) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.__init__(process_group=None, nodes=blob.get("nodes"), **blob["options"])
        self.load_state_dict(blob["state"])


def _option_property(name: str) -> property:
    return property(lambda self: getattr(self.options, name), doc=f"The ``{name}`` option (read-only).")


for _name in OPTION_NAMES:  # state.density, state.method, ...: the options, read-only
    setattr(SparsifyState, _name, _option_property(_name))

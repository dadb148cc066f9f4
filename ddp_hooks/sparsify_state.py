"""Configuration, per-bucket residuals and counters of the sparsifying hook."""

from __future__ import annotations

import logging
import struct
import warnings
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from ._internal.validation import check_bool, check_choice, check_float, check_group_ready, check_int, check_process_group
from ._internal.collectives import check_same_on_all_ranks
from .last_update import LastUpdates
from .residuals import Layout, ResidualStore
from .selection import METHODS
from .sparse_output import SparseOutputs
from .stats import CommStats

logger = logging.getLogger(__name__)

SCOPES = ("layer", "bucket", "global")
AGGREGATIONS = ("allreduce", "allgather")
OPTIMIZER_MOMENTUM = ("auto", "sends", "steps")
# Checkpoint codes of optimizer_momentum: explicit and never reused, so reordering the choices cannot
# change what a saved state means.
_OPTIMIZER_MOMENTUM_CODES = {"auto": 0, "sends": 1, "steps": 2}
_OPTIMIZER_MOMENTUM_NAMES = {code: name for name, code in _OPTIMIZER_MOMENTUM_CODES.items()}
#: Selectors whose coordinates leave at random times, regardless of their size.
RANDOM_METHODS = ("randomk", "random_block")
#: ``density_warmup_steps`` when none is given (measured: README, "Convergence on real images").
DEFAULT_DENSITY_WARMUP_STEPS = 1000
_STATE_VERSION = 1
_INT64_MAX = (1 << 63) - 1


def _float_bits(x: float) -> int:
    """The IEEE-754 bits of a double as a signed int64 (fits a checkpoint's ints and an int64 tensor)."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _bits_float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


# Options added after version 1 states were first saved, with the values those states imply.
_CONFIG_ADDED_LATER = {"momentum_bits": _float_bits(0.0), "weight_decay_bits": _float_bits(0.0),
                       "density_warmup_steps": 0}
# Options added later still (issue 16) that change which entries are sent or how the result is
# presented, not what the residuals mean: a state saved without them resumes under any value.
_CONFIG_FREE_IF_ABSENT = ("block_size", "optimizer_momentum")


class SparsifyState:
    r"""State of :func:`~ddp_hooks.sparsify_hook`: options, residuals, step counter, stats.

    Every argument is checked here, before anything touches
    ``torch.distributed``, so a bad configuration fails at once.

    Args:
        process_group: the group to communicate in; ``None`` is the default group.
        method (str): ``"topk"``, ``"randomk"`` or ``"random_block"`` (the
            paper's proposal: a random set of blocks per unit, almost free
            to select; :mod:`ddp_hooks.block_selection`).
        density (float): fraction of entries sent per unit, in (0, 1]; each
            unit sends ``ceil(density * numel)`` entries.
        scope (str): the unit of selection: ``"layer"`` (each parameter has its
            own budget, so every layer is updated every step), ``"bucket"``
            (DDP's flat bucket), ``"global"`` (all buckets of a step together;
            the exchange waits for the last bucket).
        aggregation (str): ``"allreduce"``: all ranks pick the same coordinates
            from ``(seed, step, unit)`` and only the values travel (random
            methods only); ``"allgather"``: each rank picks its own
            coordinates; top-k sends values and int32 positions, the random
            methods send values only, since every rank can recompute every
            other rank's positions from ``(seed, step, unit, rank)``.
        error_feedback (bool): keep what was not sent and add it next step.
        warmup_steps (int): plain allreduce for the first ``warmup_steps`` steps.
        density_warmup_steps (int): >= 0, or ``None`` (the default): 1000.
            After ``warmup_steps``, the
            density falls geometrically from 1 to ``density`` over this many
            steps, ``density ** (s / density_warmup_steps)`` at the ``s``-th,
            as Deep Gradient Compression (Lin et al. 2018, arXiv 1712.01887)
            lowers it over its first epochs; 0 turns it off. Why: a random
            selector sends a coordinate about once every ``1 / density``
            steps with all it gathered, and early in training, when
            gradients are large and change fast, such delayed bursts diverge;
            the decay lets the delay grow as the gradients settle (top-k,
            whose early residuals are also large, gains from it as well). It costs
            about ``density_warmup_steps * (1 - density) / ln(1 / density)``
            dense steps' bytes in all (215 for 1000 steps at density 0.01),
            and needs no knowledge of the run's length.
        seed (int): seed of the random selectors, in [0, 2**63 - 1].
        block_size (int): ``random_block`` only: entries per block, >= 1.
            Each step sends a random set of blocks (``k`` entries in all);
            1 is random-k, a size of ``k`` or more is one block of ``k``.
        momentum (float): in [0, 1). 0 (the default) leaves momentum to the
            optimizer. Above 0 the hook applies heavy-ball momentum itself,
            before the exchange (momentum correction, after Lin et al., "Deep
            Gradient Compression", ICLR 2018, arXiv 1712.01887), with a
            float32 velocity per rank that steps only where the rank sends
            (below). Pair it with ``torch.optim.SGD(momentum=0,
            weight_decay=0)``; :func:`~ddp_hooks.build_sparsify_sgd` builds
            the pair, and an optimizer that adds its own momentum is refused
            at its first step. Needs ``error_feedback=True``. Code that keeps
            its momentum optimizer needs none of this: see
            ``optimizer_momentum``.
        weight_decay (float): >= 0 (0). Adds ``weight_decay * x`` to each
            rank's gradient in the hook, before error feedback and momentum,
            as ``torch.optim.SGD`` adds it before its momentum; with
            ``momentum`` > 0 use it instead of the optimizer's.
        optimizer_momentum (str): what becomes of the momentum of a
            ``torch.optim.SGD`` the hook's gradients feed. ``"sends"``: the
            hook reads each parameter's momentum ``m`` from its optimizer
            (at the optimizer's first step, then at every step), steps a
            velocity at the positions sent (as with ``momentum`` above) and
            returns ``u_t - m u_{t-1}``, ``u_t`` this step's averaged sent
            velocity, so that the optimizer's buffer ``m buf + grad`` holds
            ``u_t`` and its step is ``lr u_t``: momentum counted in sends,
            in unchanged optimizer code, with weight decay dense in the
            optimizer (its momentum runs as in plain SGD). ``"steps"``: the
            optimizer's momentum multiplies what arrives, as in plain DDP.
            ``"auto"`` (default): ``"sends"`` with error feedback (and no
            ``momentum`` or ``weight_decay`` of the hook's own), ``"steps"``
            without (nothing is held back, so nothing leaves late). Nesterov and dampening under ``"sends"`` are refused at
            the optimizer's first step; other optimizers (Adam, ...) get the
            averaged sparse gradient as they would under ``"steps"``.
        grad_scaler (torch.amp.GradScaler): the scaler of an AMP run, or
            ``None``. Gradients reach the hook multiplied by the loss scale
            ``S``, which the scaler changes between steps; with the scaler
            given, the per-rank states are kept unscaled (``e`` in gradient
            units, ``p = g + S * e``), so a change of ``S`` cannot leave a
            stale factor ``S_new / S_old`` in them. Without it they hold
            scaled values: fine without AMP or with a constant scale. The
            scaler is not part of :meth:`state_dict` or of a pickle: give it
            again when resuming.

    Non-finite gradients (an AMP overflow, a NaN): when any rank's gradient
    holds inf or NaN at a step, every rank's output for that step is made
    non-finite (so ``GradScaler`` skips the step on every rank, as with a
    dense allreduce), and every rank's residuals keep their values from
    before the step: the step's gradient is discarded as a skipped step
    discards a dense one. The step counter still advances on every rank alike.
    ``stats()["nonfinite_steps"]`` counts such steps.

    The error-feedback recursion (Eghlidi & Jaggi 2020, arXiv 2009.09271;
    residual ``e`` starts at 0 and is kept per rank in float32):

    .. math:: p_t = g_t + e_t,\quad c_t = C_k(p_t),\quad e_{t+1} = p_t - c_t,
              \quad \hat g_t = \tfrac{1}{W}\textstyle\sum_{r} c_t^{(r)}

    With ``momentum`` m > 0 (``g_t`` includes ``wd * x_t``), each rank also
    keeps a velocity ``w`` (starts at 0) that moves only at the positions
    ``S_t`` it sends, and what it sends there is the stepped velocity:

    .. math:: p_t = g_t + e_t,\quad
              w_{t+1}[S_t] = m\,w_t[S_t] + p_t[S_t],\quad
              c_t = w_{t+1}[S_t] \text{ on } S_t,\quad
              e_{t+1} = p_t \text{ off } S_t,\ 0 \text{ on } S_t

    and ``w`` keeps its value off ``S_t``. So every gradient reaches the model
    exactly once, plus momentum's carry at each send:
    :math:`\sum_{s\le t} c_s + e_{t+1} = \sum_{s\le t} g_s +
    m \sum_{s\le t} w_s[S_s]` (per rank; the model gets the mean over
    ranks). At density 1 every position is sent at every step and this is
    momentum SGD (torch.optim.SGD with ``momentum=m, weight_decay=wd``).
    Below it momentum counts *sends*, not steps: a coordinate that waited
    ``D`` steps leaves with its ``D`` gradients plus ``m`` times its velocity
    from its last send. Why not the optimizer's momentum, or a velocity
    stepped every step (DGC's form): with a random selector a coordinate
    leaves about once every ``1 / density`` steps carrying that many
    gradients, and a velocity that steps every step multiplies that stale
    burst by ``1 / (1 - m)``; at lr 0.1, m 0.9 the burst is 20 times a dense
    step at density 0.05 and 100 at 0.01, and training diverges, as it does
    without momentum at lr 1.0 (``bench/bench_convergence.py``). In send
    time the stale burst is a heavy-ball step on ``D`` gradients, stable up to
    ``lr * D * curvature < 2 (1 + m)``, while a steady gradient still gains
    the full ``1 / (1 - m)`` over successive sends.

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
        # options, fixed at construction
        "process_group", "method", "density", "scope", "aggregation", "error_feedback",
        "warmup_steps", "seed", "momentum", "weight_decay", "grad_scaler", "block_size",
        "optimizer_momentum", "density_warmup_steps",
        # the step counter: advances once per backward, on the last bucket
        "step",
        # error feedback, momentum correction and counters; steps whose gradient was discarded
        # (0-dim tensor, or None)
        "residuals", "velocities", "_stats", "_nonfinite",
        # optimizer_momentum="sends": the last averaged update per bucket, each parameter's momentum
        # (key -> m, read from its optimizer), the optimizers seen (weak references)
        "last_updates", "_momenta", "_optimizers",
        # bound lazily at the first hook call
        "_group", "_rank", "_world_size", "_checked",
        "_param_keys", "_layouts", "_loaded_meta", "_loaded_keys",
        # within one backward: the loss scale, exchanges in flight, the step's completion (which
        # the buckets' futures follow), buckets waiting for the last one (global scope)
        "_scale", "_flights", "_step_done", "_waiting",
        # top-k: |p| and a candidate mask, kept from step to step (grown to the largest bucket)
        "_scratch_buffers",
        # CPU, float32: each bucket's result vector, kept at zero between steps (ddp_hooks.sparse_output)
        "_results",
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
        block_size: int = 16,
        optimizer_momentum: str = "auto",
        density_warmup_steps: Optional[int] = None,
    ) -> None:
        check_process_group("process_group", process_group)
        self.method = check_choice("method", method, METHODS, "the coordinate selector")
        self.density = check_float(
            "density", density, 0.0, 1.0, low_open=True,
            reason="it is the fraction of gradient entries each rank sends per step",
        )
        self.scope = check_choice("scope", scope, SCOPES, "the unit that gets its own budget")
        self.aggregation = check_choice("aggregation", aggregation, AGGREGATIONS, "how ranks combine their entries")
        self.error_feedback = check_bool("error_feedback", error_feedback)
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 0, "the number of dense steps before sparsifying")
        self.seed = check_int("seed", seed, 0, "it seeds the random selectors", maximum=_INT64_MAX)
        self.block_size = check_int("block_size", block_size, 1, "it is the number of entries in a random block")
        if density_warmup_steps is None:  # see the docstring
            density_warmup_steps = DEFAULT_DENSITY_WARMUP_STEPS
        self.density_warmup_steps = check_int("density_warmup_steps", density_warmup_steps, 0,
                                              "the number of steps over which the density falls to `density`")
        self.optimizer_momentum = check_choice("optimizer_momentum", optimizer_momentum, OPTIMIZER_MOMENTUM,
                                               "what becomes of the optimizer's momentum")
        self.momentum = check_float("momentum", momentum, 0.0, 1.0, high_open=True,
                                    reason="it is the factor of the velocity kept from one step to the next")
        self.weight_decay = check_float("weight_decay", weight_decay, 0.0, float("inf"), high_open=True,
                                        reason="it is the L2 penalty folded into each rank's gradient")
        if self.momentum > 0.0 and not self.error_feedback:
            raise ValueError(
                f"`momentum`={self.momentum!r} needs `error_feedback`=True: the hook's velocity is what error "
                "feedback accumulates; without error feedback keep momentum in the optimizer (momentum=0 here)"
            )
        if self.optimizer_momentum == "sends" and (self.momentum > 0.0 or self.weight_decay > 0.0
                                                   or not self.error_feedback):
            raise ValueError(
                "`optimizer_momentum`='sends' needs `momentum`=0, `weight_decay`=0 and `error_feedback`=True (got "
                f"momentum={self.momentum!r}, weight_decay={self.weight_decay!r}, error_feedback="
                f"{self.error_feedback!r}): it counts the optimizer's momentum in the error-feedback sends, so "
                "the hook must run no momentum or weight decay of its own (they stay in the optimizer)"
            )
        if grad_scaler is not None and not isinstance(grad_scaler, torch.amp.GradScaler):
            raise TypeError(f"`grad_scaler` must be None or a torch.amp.GradScaler, got {type(grad_scaler).__name__}; "
                            "the hook reads the loss scale from it to keep the residuals unscaled")
        self.grad_scaler = grad_scaler
        if self.method == "topk" and self.aggregation == "allreduce":
            raise ValueError(
                "`aggregation`='allreduce' cannot be used with `method`='topk': each rank's top-k entries sit "
                "at different positions, so values alone cannot be summed; use aggregation='allgather'"
            )
        if self.density == 1.0:
            warnings.warn("SparsifyState: density=1 sends every entry; the hook then costs a plain allreduce "
                          "plus bookkeeping", stacklevel=2)
        self.process_group = process_group
        self.step = 0
        self.residuals = ResidualStore()
        self.velocities = ResidualStore()  # per rank, like the residuals; used when momentum > 0
        self.last_updates = LastUpdates()
        self._momenta: Dict[int, float] = {}
        self._optimizers: list = []
        self._stats = CommStats()
        self._nonfinite: Optional[torch.Tensor] = None
        self._group = None
        self._rank = 0
        self._world_size = 1
        self._checked = False
        self._param_keys: Dict[int, int] = {}
        self._layouts: Dict[int, Tuple[Tuple[int, ...], Layout, torch.Tensor]] = {}
        self._loaded_meta: Optional[Dict[str, int]] = None
        self._loaded_keys: Optional[set] = None
        self._scale: Optional[torch.Tensor] = None
        self._scratch_buffers: Dict[torch.device, Tuple[torch.Tensor, torch.Tensor]] = {}
        self._results = SparseOutputs()  # per bucket, the result vector kept at zero (CPU, float32)
        self._flights: list = []
        self._step_done: Optional[torch.futures.Future] = None
        self._waiting: list = []

    # ----- options as ints, for checkpoints and the cross-rank check -----
    def _config_ints(self) -> Dict[str, int]:
        return {
            "method": METHODS.index(self.method),
            "scope": SCOPES.index(self.scope),
            "aggregation": AGGREGATIONS.index(self.aggregation),
            "density_e9": round(self.density * 1e9),
            "error_feedback": int(self.error_feedback),
            "warmup_steps": self.warmup_steps,
            "seed": self.seed,
            # exact: the float's IEEE-754 bits, so a resume cannot round momentum or weight decay
            "momentum_bits": _float_bits(self.momentum),
            "weight_decay_bits": _float_bits(self.weight_decay),
            "block_size": self.block_size,
            "optimizer_momentum": _OPTIMIZER_MOMENTUM_CODES[self.optimizer_momentum],
            "density_warmup_steps": self.density_warmup_steps,
        }

    def _describe(self, ints: Dict[str, int]) -> str:
        return (f"method={METHODS[ints['method']]!r}, density={ints['density_e9'] / 1e9:g}, "
                f"scope={SCOPES[ints['scope']]!r}, aggregation={AGGREGATIONS[ints['aggregation']]!r}, "
                f"error_feedback={bool(ints['error_feedback'])}, warmup_steps={ints['warmup_steps']}, "
                f"seed={ints['seed']}, momentum={_bits_float(ints['momentum_bits']):g}, "
                f"weight_decay={_bits_float(ints['weight_decay_bits']):g}, "
                f"block_size={ints.get('block_size', '(not saved)')}, optimizer_momentum="
                f"{_OPTIMIZER_MOMENTUM_NAMES.get(ints.get('optimizer_momentum'), '(not saved)')!r}, "
                f"density_warmup_steps={ints.get('density_warmup_steps', '(not saved)')}")

    # ----- what the options imply -----
    @property
    def counts_momentum_in_sends(self) -> bool:
        """True when the optimizer's momentum is counted in sends (``optimizer_momentum``, resolved)."""
        if self.optimizer_momentum == "auto":
            return self.error_feedback and self.momentum == 0.0 and self.weight_decay == 0.0
        return self.optimizer_momentum == "sends"

    def density_at(self, step: int) -> float:
        """The density of step ``step``: 1 during the warm-up, then ``density_warmup_steps`` of geometric decay."""
        into = step - self.warmup_steps
        if into < 0:
            return 1.0
        if into >= self.density_warmup_steps:
            return self.density
        return max(self.density, self.density ** (into / self.density_warmup_steps))

    @property
    def runs_velocity(self) -> bool:
        """True while the hook keeps a velocity: its own momentum, or an optimizer momentum above 0 or not yet read.

        With the optimizer's momentum counted in sends the velocity runs from
        the first step (where no optimizer has been seen yet: its momentum is
        unknown, and a velocity stepped with 0 holds what was sent) until the
        optimizers seen turn out to have none (SGD without momentum, Adam).
        """
        if self.momentum > 0.0:
            return True
        if not self.counts_momentum_in_sends:
            return False
        return not self._momenta or any(m > 0.0 for m in self._momenta.values())

    def send_momentum(self, layout: Layout, device: torch.device):
        """The momentum the hook's velocity steps with in a bucket of this layout.

        ``None`` when no velocity runs (:attr:`runs_velocity`); a float when
        every parameter of the bucket has the same; else a float32 tensor
        with one per parameter. With the optimizer's momentum counted in
        sends, a parameter whose optimizer has not been seen counts 0.
        """
        if self.momentum > 0.0:
            return self.momentum
        if not self.runs_velocity:
            return None
        momenta = [self._momenta.get(key, 0.0) for key, _, _ in layout]
        if not momenta or all(m == momenta[0] for m in momenta):
            return momenta[0] if momenta else 0.0
        return torch.tensor(momenta, dtype=torch.float32, device=device)

    def refresh_momenta(self) -> None:
        """Read each parameter's momentum from the optimizers seen at their first step (weak references).

        A parameter counts the ``momentum`` of its ``torch.optim.SGD`` group,
        read again at every step's first bucket, so a momentum schedule that
        changes it between steps is followed; other optimizers count 0 (they
        get the averaged gradient as it is).
        """
        ran_velocity = self.runs_velocity
        alive, momenta = [], {}
        for ref in self._optimizers:
            optimizer = ref()
            if optimizer is None:
                continue
            alive.append(ref)
            is_sgd = isinstance(optimizer, torch.optim.SGD)
            for group in optimizer.param_groups:
                m = float(group.get("momentum", 0.0)) if is_sgd else 0.0
                for p in group["params"]:
                    key = self._param_keys.get(id(p))
                    if key is not None:
                        momenta[key] = m
        self._optimizers = alive
        self._momenta = momenta
        if ran_velocity and not self.runs_velocity:  # no momentum to count any more: drop the velocity
            self.velocities.load({})  # (it restarts at 0 if a momentum comes back)

    # ----- binding to the process group, at the first hook call -----
    def _bind(self, bucket: dist.GradBucket) -> None:
        if self._checked:
            return
        device = bucket.buffer().device
        group = check_group_ready(self.process_group, device, "sparsify_hook")
        self._group = group
        self._rank = dist.get_rank(group)
        self._world_size = dist.get_world_size(group)
        self._check_same_config_on_all_ranks(device)
        self._check_loaded_meta()
        self._checked = True
        from .sparsify_sgd import watch_first_step  # (imports this module)

        watch_first_step(self)
        if self._rank == 0:
            logger.info("sparsify_hook: %s on %d ranks", self._describe(self._config_ints()), self._world_size)

    def _check_same_config_on_all_ranks(self, device: torch.device) -> None:
        """One small allgather at the first step: every rank fails alike on a mismatch."""
        settings = {**self._config_ints(), "grad_scaler": int(self.grad_scaler is not None)}

        def describe(s):
            return f"{self._describe(s)}, grad_scaler={'given' if s['grad_scaler'] else 'None'}"

        check_same_on_all_ranks(settings, self._group, self._world_size, device, "SparsifyState options",
                                "every rank must select and aggregate alike", describe)

    def _check_loaded_meta(self) -> None:
        meta = self._loaded_meta
        if meta is None:
            return
        if meta["world_size"] != self._world_size:
            raise ValueError(
                f"the hook state was saved on {meta['world_size']} ranks but this run has {self._world_size}: "
                "error-feedback residuals belong to one rank each and cannot be redistributed; "
                "resume on the same number of ranks, or drop the residuals with load_state_dict(sd, "
                "residuals=False)"
            )
        if meta["rank"] != self._rank:
            raise ValueError(f"rank {self._rank} loaded the hook state saved by rank {meta['rank']}: "
                             "each rank must load its own file, since residuals differ per rank")

    # ----- the layout of a bucket: (parameter key, offset, numel) -----
    def _layout(self, bucket: dist.GradBucket) -> Tuple[Layout, torch.Tensor]:
        """The bucket's layout and, on its device, the offsets where its parameters start (increasing)."""
        params = bucket.parameters()
        ids = tuple(id(p) for p in params)
        cached = self._layouts.get(bucket.index())
        if cached is not None and cached[0] == ids:
            return cached[1], cached[2]
        buffer = bucket.buffer()
        base, size = buffer.data_ptr(), buffer.element_size()
        layout, end = [], 0
        for p, g in zip(params, bucket.gradients()):
            key = self._param_keys.setdefault(id(p), len(self._param_keys))
            # an empty gradient's data pointer may be anything (often 0): place it where the previous one ended
            offset = (g.data_ptr() - base) // size if g.numel() else end
            layout.append((key, offset, g.numel()))
            end = offset + g.numel()
        layout = tuple(layout)
        offsets = [offset for _, offset, _ in layout]
        if offsets != sorted(offsets):  # the hook maps positions to parameters by binary search
            raise RuntimeError(f"DDP bucket {bucket.index()} lays out its parameters at offsets {offsets}, "
                               "not in increasing order; sparsify_hook cannot map positions to parameters")
        starts = torch.tensor(offsets, dtype=torch.int64, device=buffer.device)
        self._layouts[bucket.index()] = (ids, layout, starts)
        return layout, starts

    def _scratch(self, numel: int, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        """A float32 vector of ``numel`` and a bool mask of ``numel`` rounded up to 8, reused across steps."""
        floats, mask = self._scratch_buffers.get(device, (None, None))
        if floats is None or floats.numel() < numel:
            floats = torch.empty(numel, dtype=torch.float32, device=device)
            mask = torch.empty((numel + 7) // 8 * 8, dtype=torch.bool, device=device)
            self._scratch_buffers[device] = (floats, mask)
        return floats[:numel], mask

    def _begin_step(self, device: torch.device) -> None:
        """At the first bucket of a backward: drop leftovers of a backward that raised; read the loss scale."""
        self._flights, self._waiting = [], []
        self._step_done = torch.futures.Future()
        if self._optimizers and self.counts_momentum_in_sends:
            self.refresh_momenta()
        scaler = self.grad_scaler
        # GradScaler.scale(t) is t * S on t's device: S as a tensor, without a host sync.
        self._scale = None if scaler is None else scaler.scale(torch.ones((), dtype=torch.float32, device=device))

    def _count_nonfinite(self, bad: torch.Tensor) -> None:
        if self._nonfinite is None or self._nonfinite.device != bad.device:
            start = 0 if self._nonfinite is None else self._nonfinite.item()  # once, after a load
            self._nonfinite = torch.tensor(start, dtype=torch.int64, device=bad.device)
        self._nonfinite.add_(bad)

    def _end_step(self, last_index: int, compressed: bool) -> None:
        self.step += 1
        self._stats.steps += 1
        self._stats.compressed_steps += int(compressed)
        self.residuals.drop_buckets_after(last_index)
        self.velocities.drop_buckets_after(last_index)
        self.last_updates.drop_buckets_after(last_index)
        self._results.drop_buckets_after(last_index)
        for index in [i for i in self._layouts if i > last_index]:
            del self._layouts[index]
        for what, store in (("residuals", self.residuals), ("velocities", self.velocities)):
            if store.pending_keys:
                raise ValueError(
                    f"the loaded hook state holds {what} for parameters {store.pending_keys} that this "
                    "model does not have: the state was saved from a different model"
                )
        if compressed and self._loaded_keys:
            extra = sorted(set(self._param_keys.values()) - self._loaded_keys)
            if extra:
                raise ValueError(
                    f"this model has parameters {extra} for which the loaded hook state holds no residual: "
                    "the state was saved from a different model"
                )
            self._loaded_keys = None  # checked once, at the first compressed step after loading

    # ----- public API -----
    def stats(self) -> Dict[str, float]:
        """Counts since the start: steps, elements and bytes sent vs dense, their ratio, discarded steps.

        ``nonfinite_steps`` counts the compressed steps whose gradient held
        inf or NaN on some rank (reading it waits for the device on CUDA).
        """
        return {**self._stats.as_dict(), "nonfinite_steps": self._nonfinite_steps()}

    def _nonfinite_steps(self) -> int:
        return 0 if self._nonfinite is None else int(self._nonfinite)

    def state_dict(self) -> Dict[str, Any]:
        """Step, residuals and velocities (this rank's), counters and options; tensors and ints only.

        Loads with ``torch.load(..., weights_only=True)``. Residuals differ per
        rank: every rank saves and loads its own.
        """
        if self._flights or self._waiting:
            raise RuntimeError("state_dict() was called in the middle of a backward pass")
        return {
            "version": _STATE_VERSION,
            "step": self.step,
            "config": self._config_ints(),
            "rank": self._rank if self._checked else (self._loaded_meta or {}).get("rank", 0),
            "world_size": self._world_size if self._checked else (self._loaded_meta or {}).get("world_size", 1),
            "residuals": self.residuals.state() if self.error_feedback else {},
            "velocities": self.velocities.state() if self.runs_velocity else {},
            "stats": self._stats.state_dict(),
            "nonfinite_steps": self._nonfinite_steps(),
            "last_updates": self.last_updates.state(),
            "optimizer_momenta": dict(sorted(self._momenta.items())),
        }

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
        if not isinstance(state_dict, dict):
            raise TypeError(f"`state_dict` must be a dict from SparsifyState.state_dict(), got {type(state_dict).__name__}")
        missing = {"version", "step", "config", "rank", "world_size", "residuals", "stats"} - set(state_dict)
        if missing:
            raise ValueError(f"`state_dict` lacks {sorted(missing)}: it is not a SparsifyState.state_dict()")
        if state_dict["version"] != _STATE_VERSION:
            raise ValueError(f"hook state version {state_dict['version']!r} is not supported (expected {_STATE_VERSION})")
        absent = [name for name in _CONFIG_FREE_IF_ABSENT if name not in state_dict["config"]]
        saved, mine = {**_CONFIG_ADDED_LATER, **state_dict["config"]}, self._config_ints()
        if absent:
            logger.warning("SparsifyState: the hook state was saved before %s existed; it resumes with %s",
                           ", ".join(absent), ", ".join(f"{name}={getattr(self, name)!r}" for name in absent))
            saved.update({name: mine[name] for name in absent})
        if saved != mine:
            raise ValueError(
                f"the hook state was saved with {self._describe(saved)} but this SparsifyState has "
                f"{self._describe(mine)}; build the state with the saved options to resume"
            )
        check_int("state_dict['step']", state_dict["step"], 0)
        self.step = state_dict["step"]
        self._stats.load_state_dict(state_dict["stats"])
        nonfinite = state_dict.get("nonfinite_steps", 0)  # absent in states saved before it was counted
        self._nonfinite = None if not nonfinite else torch.tensor(check_int("nonfinite_steps", nonfinite, 0))
        self.residuals.load(state_dict["residuals"] if residuals else {})
        self.velocities.load(state_dict.get("velocities", {}) if residuals else {})
        self.last_updates.load(state_dict.get("last_updates", {}) if residuals else {})
        self._momenta = {int(k): float(v) for k, v in state_dict.get("optimizer_momenta", {}).items()}
        if not self.runs_velocity:
            self.velocities.load({})
        self._loaded_keys = {int(k) for k in state_dict["residuals"]} if residuals else None
        self._layouts.clear()
        self._loaded_meta = {"rank": state_dict["rank"], "world_size": state_dict["world_size"]} if residuals else None
        if self._checked:
            self._check_loaded_meta()

    def __getstate__(self):
        """Pickle support, as PyTorch's PowerSGDState: the process group is not serialisable and is dropped."""
        logger.warning("SparsifyState: the process group is not serialisable and is excluded from the pickle")
        return {"options": {"method": self.method, "density": self.density, "scope": self.scope,
                            "aggregation": self.aggregation, "error_feedback": self.error_feedback,
                            "warmup_steps": self.warmup_steps, "seed": self.seed,
                            "momentum": self.momentum, "weight_decay": self.weight_decay,
                            "block_size": self.block_size, "optimizer_momentum": self.optimizer_momentum,
                            "density_warmup_steps": self.density_warmup_steps},
                "state": self.state_dict()}

    def __setstate__(self, blob) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.__init__(process_group=None, **blob["options"])
        self.load_state_dict(blob["state"])

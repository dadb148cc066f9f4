"""The options of the sparsifying hook: one frozen value, checked once, with its checkpoint codes.

:class:`SparsifyOptions` holds what :class:`~ddp_hooks.SparsifyState` was
built with (minus the process group and the grad scaler, which are objects,
not values). Every argument is checked here, before anything touches
``torch.distributed``; each error names the argument, the value, the rule
and why. Checkpoints and the cross-rank agreement check see the options as
ints (:meth:`SparsifyOptions.config_ints`): every choice has an explicit
code that is never reused, and floats travel as their IEEE-754 bits.

Example::

    >>> options = SparsifyOptions(method="random_block", density=0.01)
    >>> options.density_at(0), options.density_at(2000), options.counts_momentum_in_sends
    (1.0, 0.01, True)
    >>> SparsifyOptions(density=1.5)
    Traceback (most recent call last):
    ...
    ValueError: `density` must be a float in (0, 1], got 1.5; it is the fraction of gradient entries each rank sends per step
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Union

import torch

from .._internal.codec import bits_to_float, float_to_bits
from .._internal.validation import check_bool, check_choice, check_float, check_int
from .selectors import Selector, selector_by_code, selector_class, selector_names

__all__ = ["SparsifyOptions", "SCOPE_CODES", "AGGREGATION_CODES", "OPTIMIZER_MOMENTUM_CODES", "VALUE_DTYPE_CODES",
           "DEFAULT_DENSITY_WARMUP_STEPS", "DEFAULT_DENSITY_WARMUP_START"]

# Checkpoint codes: explicit and never reused, so reordering or adding choices cannot change what a saved
# state means. (A selector's code is its class attribute `code`.)
SCOPE_CODES = {"layer": 0, "bucket": 1, "global": 2}
AGGREGATION_CODES = {"allreduce": 0, "allgather": 1}
OPTIMIZER_MOMENTUM_CODES = {"auto": 0, "sends": 1, "steps": 2}
VALUE_DTYPE_CODES = {"auto": 0, "float16": 1, "bfloat16": 2, "float32": 3}  # "auto": the gradient's own dtype
#: ``density_warmup_steps`` when none is given (measured: bench/README.md, "Convergence on real images").
DEFAULT_DENSITY_WARMUP_STEPS = 1000
DEFAULT_DENSITY_WARMUP_START = 1.0
_INT64_MAX = (1 << 63) - 1


def _name_of(codes: Dict[str, int], code) -> str:
    return next((name for name, c in codes.items() if c == code), f"(unknown code {code!r})")


@dataclass(frozen=True)
class SparsifyOptions:
    r"""The options of :class:`~ddp_hooks.SparsifyState`, checked; frozen.

    Args:
        method (str): ``"topk"``, ``"randomk"`` or ``"random_block"`` (the
            paper's proposal: a random set of blocks per unit, almost free
            to select; :mod:`ddp_hooks.sparsify.selectors.random_block`), or
            any selector registered with
            :func:`~ddp_hooks.sparsify.selectors.register_selector`.
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
            After ``warmup_steps``, the density falls geometrically from
            ``density_warmup_start`` (``s0``) to ``density`` (``d``) over this
            many steps, ``s0 * (d / s0) ** (s / density_warmup_steps)`` at the
            ``s``-th, as Deep Gradient Compression (Lin et al. 2018, arXiv
            1712.01887) lowers it over its first epochs; 0 turns it off. Why:
            a random selector sends a coordinate about once every
            ``1 / density`` steps with all it gathered, and early in
            training, when gradients are large and change fast, such delayed
            bursts diverge; the decay lets the delay grow as the gradients
            settle. It costs about
            ``density_warmup_steps * (s0 - d) / ln(s0 / d)`` dense steps'
            bytes in all, and needs no knowledge of the run's length.
        density_warmup_start (float): in (0, 1], or ``None`` (the default):
            1. Where that fall starts. A lower start costs fewer bytes (the
            formula above) and may cost accuracy: measured in
            bench/README.md, "Shared top-k and the warm-up's bytes". A start
            at or below ``density`` turns the warm-up off.
        error_feedback_beta (float): in (0, 1] (1). Below 1, a low-pass
            filter on the error-feedback memory, after ScaleCom (Chen et al.,
            NeurIPS 2020): ``e_{t+1} = (1 - beta) e_t + beta (p_t - c_t)``,
            i.e. ``e + beta g`` where nothing was sent and ``(1 - beta) e``
            where it was. It gives up exact mass conservation: a fraction
            ``1 - beta`` of each sent residual stays to be sent again, and
            only ``beta`` of each unsent gradient is kept. Needs error feedback.
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
        value_dtype (str or torch.dtype): the dtype the values travel in:
            ``None`` (the default: the gradient's own), ``"float16"``,
            ``"bfloat16"`` or ``"float32"`` (``torch.float16`` and so on are
            taken too). With error feedback the rounding to it stays in the
            residual, ``e = p - round(p)`` at the sent positions, and is sent
            later; so half values halve the bytes of every exchange (of the
            density warm-up's dense early steps most) at the cost of rounding
            that is delayed, not lost. The sum over ranks is taken in that
            dtype, as PyTorch's ``fp16_compress_hook`` does (after dividing
            by the world size); a float16 overflow makes the step's result
            non-finite, and the step is discarded on every rank.
    """

    method: str = "random_block"
    density: float = 0.01
    scope: str = "layer"
    aggregation: str = "allreduce"
    error_feedback: bool = True
    warmup_steps: int = 0
    seed: int = 0
    momentum: float = 0.0
    weight_decay: float = 0.0
    block_size: int = 4
    optimizer_momentum: str = "auto"
    density_warmup_steps: Optional[int] = None
    error_feedback_beta: float = 1.0
    value_dtype: Optional[Union[str, torch.dtype]] = None
    density_warmup_start: Optional[float] = None
    selector: Selector = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        def set_(name, value):
            object.__setattr__(self, name, value)

        set_("method", check_choice("method", self.method, selector_names(), "the coordinate selector"))
        set_("density", check_float("density", self.density, 0.0, 1.0, low_open=True,
                                    reason="it is the fraction of gradient entries each rank sends per step"))
        set_("scope", check_choice("scope", self.scope, SCOPE_CODES, "the unit that gets its own budget"))
        set_("aggregation", check_choice("aggregation", self.aggregation, AGGREGATION_CODES,
                                         "how ranks combine their entries"))
        check_bool("error_feedback", self.error_feedback)
        check_int("warmup_steps", self.warmup_steps, 0, "the number of dense steps before sparsifying")
        check_int("seed", self.seed, 0, "it seeds the random selectors", maximum=_INT64_MAX)
        check_int("block_size", self.block_size, 1, "it is the number of entries in a random block")
        if self.density_warmup_steps is None:  # see SparsifyState's docstring
            set_("density_warmup_steps", DEFAULT_DENSITY_WARMUP_STEPS)
        check_int("density_warmup_steps", self.density_warmup_steps, 0,
                  "the number of steps over which the density falls to `density`")
        if self.density_warmup_start is None:  # as density_warmup_steps: None is the default
            set_("density_warmup_start", DEFAULT_DENSITY_WARMUP_START)
        set_("density_warmup_start", check_float(
            "density_warmup_start", self.density_warmup_start, 0.0, 1.0, low_open=True,
            reason="it is the fraction of entries sent at the first step of the density warm-up"))
        check_choice("optimizer_momentum", self.optimizer_momentum, OPTIMIZER_MOMENTUM_CODES,
                     "what becomes of the optimizer's momentum")
        set_("momentum", check_float("momentum", self.momentum, 0.0, 1.0, high_open=True,
                                     reason="it is the factor of the velocity kept from one step to the next"))
        set_("weight_decay", check_float("weight_decay", self.weight_decay, 0.0, float("inf"), high_open=True,
                                         reason="it is the L2 penalty folded into each rank's gradient"))
        set_("error_feedback_beta", check_float(
            "error_feedback_beta", self.error_feedback_beta, 0.0, 1.0, low_open=True,
            reason="it is the factor of the low-pass filter on the error-feedback memory (1: no filter)"))
        if self.error_feedback_beta != 1.0 and not self.error_feedback:
            raise ValueError(f"`error_feedback_beta`={self.error_feedback_beta!r} needs `error_feedback`=True: it "
                             "filters the error-feedback memory, which does not exist without it")
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
        set_("value_dtype", _value_dtype_name(self.value_dtype))
        selector_type = selector_class(self.method)
        if self.aggregation not in selector_type.aggregations:
            allowed = " or ".join(repr(a) for a in selector_type.aggregations)
            raise ValueError(
                f"`aggregation`={self.aggregation!r} cannot be used with `method`={self.method!r}: "
                f"{selector_type.aggregation_reason}; use aggregation={allowed}"
            )
        set_("selector", selector_type.from_options(self))

    # ----- what the options imply -----
    @property
    def counts_momentum_in_sends(self) -> bool:
        """True when the optimizer's momentum is counted in sends (``optimizer_momentum``, resolved)."""
        if self.optimizer_momentum == "auto":
            return self.error_feedback and self.momentum == 0.0 and self.weight_decay == 0.0
        return self.optimizer_momentum == "sends"

    def wire_dtype(self, grad_dtype: torch.dtype) -> torch.dtype:
        """The dtype the values of a gradient of ``grad_dtype`` travel in (``value_dtype``)."""
        return grad_dtype if self.value_dtype is None else getattr(torch, self.value_dtype)

    def density_at(self, step: int) -> float:
        """The density of step ``step``: 1 during ``warmup_steps``, then ``density_warmup_steps`` of geometric
        decay from ``density_warmup_start`` to ``density``."""
        into = step - self.warmup_steps
        if into < 0:
            return 1.0
        start = max(self.density, self.density_warmup_start)
        if into >= self.density_warmup_steps or start == self.density:
            return self.density
        return max(self.density, start * (self.density / start) ** (into / self.density_warmup_steps))

    def as_kwargs(self) -> Dict[str, object]:
        """The options as ``SparsifyState`` keyword arguments."""
        return {name: getattr(self, name) for name in OPTION_NAMES}

    # ----- as ints, for checkpoints and the cross-rank check -----
    def config_ints(self) -> Dict[str, int]:
        return {
            "method": self.selector.code,
            "scope": SCOPE_CODES[self.scope],
            "aggregation": AGGREGATION_CODES[self.aggregation],
            "density_e9": round(self.density * 1e9),
            "error_feedback": int(self.error_feedback),
            "warmup_steps": self.warmup_steps,
            "seed": self.seed,
            # exact: the float's IEEE-754 bits, so a resume cannot round momentum or weight decay
            "momentum_bits": float_to_bits(self.momentum),
            "weight_decay_bits": float_to_bits(self.weight_decay),
            "block_size": self.block_size,
            "optimizer_momentum": OPTIMIZER_MOMENTUM_CODES[self.optimizer_momentum],
            "density_warmup_steps": self.density_warmup_steps,
            "density_warmup_start_bits": float_to_bits(self.density_warmup_start),
            "error_feedback_beta_bits": float_to_bits(self.error_feedback_beta),
            "value_dtype": VALUE_DTYPE_CODES[self.value_dtype or "auto"],
        }

    @staticmethod
    def describe(ints: Dict[str, int]) -> str:
        """:meth:`config_ints` (or a checkpoint's, possibly older and shorter) as ``name=value`` text."""
        try:
            method = selector_by_code(ints["method"]).name
        except KeyError:
            method = f"(unknown code {ints['method']!r})"
        return (f"method={method!r}, density={ints['density_e9'] / 1e9:g}, "
                f"scope={_name_of(SCOPE_CODES, ints['scope'])!r}, "
                f"aggregation={_name_of(AGGREGATION_CODES, ints['aggregation'])!r}, "
                f"error_feedback={bool(ints['error_feedback'])}, warmup_steps={ints['warmup_steps']}, "
                f"seed={ints['seed']}, momentum={bits_to_float(ints['momentum_bits']):g}, "
                f"weight_decay={bits_to_float(ints['weight_decay_bits']):g}, "
                f"block_size={ints.get('block_size', '(not saved)')}, optimizer_momentum="
                + (repr(_name_of(OPTIMIZER_MOMENTUM_CODES, ints['optimizer_momentum']))
                   if 'optimizer_momentum' in ints else "'(not saved)'")
                + f", density_warmup_steps={ints.get('density_warmup_steps', '(not saved)')}"
                + (f", density_warmup_start={bits_to_float(ints['density_warmup_start_bits']):g}"
                   if "density_warmup_start_bits" in ints else ", density_warmup_start=(not saved)")
                + f", error_feedback_beta={bits_to_float(ints.get('error_feedback_beta_bits', float_to_bits(1.0))):g}"
                + ", value_dtype=" + repr(_value_dtype_of_code(ints.get("value_dtype", 0))))


def _value_dtype_name(value) -> Optional[str]:
    """``value_dtype`` checked, as a name (``None`` for the gradient's own dtype)."""
    if value is None:
        return None
    name = str(value).rpartition(".")[2] if isinstance(value, torch.dtype) else value
    choices = [c for c in VALUE_DTYPE_CODES if c != "auto"]
    if name not in choices:
        raise ValueError(f"`value_dtype` must be None or one of {', '.join(repr(c) for c in choices)} (or the "
                         f"torch dtype of that name), got {value!r}; it is the dtype the sent values travel in")
    return name


def _value_dtype_of_code(code: int) -> Optional[str]:
    name = _name_of(VALUE_DTYPE_CODES, code)
    return None if name == "auto" else name


#: The constructor arguments of :class:`SparsifyOptions`, in order.
OPTION_NAMES = tuple(f for f in SparsifyOptions.__dataclass_fields__ if f != "selector")

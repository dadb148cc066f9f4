"""The one step schedule that Local AdaAlter's hook, optimizer and averager share.

Local AdaAlter (Xie, Koyejo, Gupta & Lin, 2019, arXiv 1911.09030) runs
``warmup_steps`` fully synchronous steps (the comm hook averages gradients),
then rounds of ``period`` local steps (no gradient traffic) each closed by a
synchronisation that averages parameters and accumulators. Whether a step is a
warm-up step is decided twice per step: by the hook during ``backward`` and by
the optimizer in ``step``. If each counted steps on its own they would drift
apart as soon as a step is skipped (``GradScaler`` skips ``optimizer.step()``
on inf/NaN gradients while the hook already counted the backward: PyTorch
issue 76282, https://github.com/pytorch/pytorch/issues/76282). So there is a
single counter, :class:`LocalAdaAlterSchedule`, *advanced only by the
optimizer* after a step it really took; the hook only reads it.

Step numbering: ``step`` is the number of steps taken so far, so the step
being computed is ``t = step + 1``; it is a warm-up step when
``t <= warmup_steps``. ``last_sync`` is ``t0``, the last step after which all
ranks held the same parameters and accumulators (every warm-up step is one).
"""

from __future__ import annotations

import weakref
import zlib
from typing import Callable, Dict, Iterable, Optional

from torch.utils.weak import WeakIdKeyDictionary

from .._internal.validation import check_int
from .._internal.collectives import check_same_on_all_ranks
from .lazy_correction import RULE_CODES, check_rule
from .outer_sgd import outer_settings
from .sparse_average import sparse_settings

__all__ = ["LocalAdaAlterSchedule"]

# Parameter -> the schedule of the LocalAdaAlter optimizer that owns it. A hook
# state built on its own finds the optimizer's schedule through the parameters
# DDP hands it in each bucket, so `LocalSGDState(warmup_steps=W)` plus
# `LocalAdaAlter(..., warmup_steps=W)` built separately still share one counter.
_OWNERS = WeakIdKeyDictionary()

_KEYS = ("warmup_steps", "period", "step", "last_sync")


class LocalAdaAlterSchedule:
    """Step counter and synchronisation calendar of Local AdaAlter.

    Args:
        warmup_steps (int): number of fully synchronous steps, >= 0.
        period (int): local steps between two averagings after warm-up, >= 1
            (the paper's ``H``); ``None`` only for a hook's own schedule (the
            hook never needs it; stored as 0 and taken from a loaded state).

    The schedule is part of the checkpoint (:meth:`state_dict`): a resumed run
    neither repeats warm-up steps nor shifts its synchronisations.

    Example::

        >>> s = LocalAdaAlterSchedule(warmup_steps=1, period=2)
        >>> [(s.in_warmup, s.local_steps_next(), s.advance()) for _ in range(5)]
        [(True, 1, False), (False, 1, False), (False, 2, True), (False, 1, False), (False, 2, True)]
        >>> s.state_dict()
        {'warmup_steps': 1, 'period': 2, 'step': 5, 'last_sync': 5}
    """

    __slots__ = ("warmup_steps", "period", "step", "last_sync", "has_driver", "cross_checked", "_driver_settings")

    def __init__(self, warmup_steps: int = 0, period: Optional[int] = 1) -> None:
        self.warmup_steps = check_int(
            "warmup_steps", warmup_steps, 0, "it is the number of synchronous steps before local steps start"
        )
        if period is not None:
            check_int("period", period, 1, "it is the number of local steps between averagings")
        self.period = period
        self.step = 0
        self.last_sync = 0
        # True once an optimizer advances this schedule; a hook state whose
        # schedule has no driver counts backward passes itself (fallback).
        self.has_driver = False
        # True once all ranks were found to agree (check_across_ranks).
        self.cross_checked = False
        # The driving optimizer's settings for that check (a weak method).
        self._driver_settings: Optional[Callable[[], Optional[Callable[[], Dict]]]] = None

    @property
    def in_warmup(self) -> bool:
        """Whether the next step (``t = step + 1``) is a synchronous warm-up step."""
        return self.step < self.warmup_steps

    def local_steps_next(self) -> int:
        """``t - t0`` for the next step: 1 in warm-up, 1..period after it."""
        return self.step + 1 - self.last_sync

    def advance(self) -> bool:
        """Record one step taken; return True when it must end with an averaging."""
        self.step += 1
        if self.step <= self.warmup_steps:
            self.last_sync = self.step  # synchronous step: ranks agree already
            return False
        if self.period is not None and self.step - self.last_sync >= self.period:
            self.last_sync = self.step
            return True
        return False

    def check_same_warmup(self, warmup_steps: int, what: str) -> None:
        """Raise ValueError unless ``warmup_steps`` equals this schedule's."""
        if warmup_steps != self.warmup_steps:
            raise ValueError(
                f"{what} was built with `warmup_steps`={warmup_steps} but the LocalAdaAlter schedule it is used "
                f"with has `warmup_steps`={self.warmup_steps}; the hook would average gradients on different steps "
                "than the optimizer expects. Build both from the same numbers, e.g. with build_local_adaalter()"
            )

    def set_driver(self, settings: Callable[[], Dict]) -> None:
        """Mark an optimizer as the one that advances this schedule; ``settings`` feeds the cross-rank check."""
        self.has_driver = True
        self._driver_settings = weakref.WeakMethod(settings)

    def check_across_ranks(self, group, world_size: int, device) -> None:
        """Once, at the first hook call or step: raise the same ``ValueError`` on every rank unless all agree.

        Compares, with one small ``all_gather``: warm-up, period, step and
        last synchronisation (ranks resumed from different checkpoints differ
        there), and the driving optimizer's learning rate, eps, correction,
        parameter groups and number of averaged elements. Ranks that differ in
        any of these would average on different steps or tensors of different
        sizes: a hang or averaged garbage.
        """
        if self.cross_checked:
            return
        driver = self._driver_settings() if self._driver_settings is not None else None
        settings = {**self.state_dict(), **(driver() if driver is not None else _NO_DRIVER)}
        check_same_on_all_ranks(settings, group, world_size, device, "Local AdaAlter settings",
                                "build every rank's optimizer and hook from the same numbers (and resume every rank "
                                "from the same step)")
        self.cross_checked = True

    def state_dict(self) -> Dict[str, int]:
        """Plain ints only (loads under ``torch.load(weights_only=True)``)."""
        return {k: int(getattr(self, k) or 0) for k in _KEYS}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        """Restore ``step`` and ``last_sync``; the configured numbers must match."""
        missing = [k for k in _KEYS if k not in state]
        if missing:
            raise ValueError(f"schedule state lacks {missing}; expected the keys {list(_KEYS)}")
        if self.period is None and int(state["period"]) > 0:
            self.period = int(state["period"])
        for k in ("warmup_steps", "period"):
            if int(state[k]) != (getattr(self, k) or 0):
                raise ValueError(
                    f"checkpoint schedule has `{k}`={int(state[k])} but this run was built with "
                    f"`{k}`={getattr(self, k)}; resuming would shift warm-up or synchronisation steps"
                )
        step, last_sync = int(state["step"]), int(state["last_sync"])
        if not 0 <= last_sync <= step:
            raise ValueError(f"schedule state needs 0 <= last_sync <= step, got last_sync={last_sync}, step={step}")
        self.step, self.last_sync = step, last_sync
        self.cross_checked = False  # compare the resumed step across ranks at the next hook call or step

    def __repr__(self) -> str:
        return (f"LocalAdaAlterSchedule(warmup_steps={self.warmup_steps}, period={self.period}, "
                f"step={self.step}, last_sync={self.last_sync})")


# Settings of the cross-rank check for a schedule without an optimizer (same keys as the optimizer's).
_NO_DRIVER = {"optimizer": False, "lr": 0.0, "eps": 0.0, "lazy_correction": 0, "param_groups": 0,
              "averaged_numel": 0, "groups_crc32": 0, **outer_settings(None), **sparse_settings(None),
              "accumulators_every": 0, "compress_accumulators": False}


def driver_settings(param_groups) -> Dict:
    """The cross-rank check's view of an optimizer: group 0's numbers, and a checksum over all groups."""
    first = param_groups[0]
    every = repr([[float(g["lr"]), float(g["eps"]), RULE_CODES[check_rule(g["lazy_correction"])],
                   sum(p.numel() for p in g["params"])] for g in param_groups])
    return {"optimizer": True, "lr": float(first["lr"]), "eps": float(first["eps"]),
            "lazy_correction": RULE_CODES[check_rule(first["lazy_correction"])], "param_groups": len(param_groups),
            "averaged_numel": sum(p.numel() for g in param_groups for p in g["params"]),
            "groups_crc32": zlib.crc32(every.encode())}


def register_owner(params: Iterable, schedule: LocalAdaAlterSchedule) -> None:
    """Record ``schedule`` as the one that ``params``' optimizer advances (held weakly, by identity)."""
    for p in params:
        _OWNERS[p] = schedule


def find_owner(params: Iterable) -> Optional[LocalAdaAlterSchedule]:
    """The schedule registered for the first of ``params`` that has one, else ``None``.

    This is how a hook state built on its own finds its optimizer's schedule
    from the parameters DDP hands it in a bucket.
    """
    for p in params:
        owner = _OWNERS.get(p)
        if owner is not None:
            return owner
    return None

"""What a ``LocalAdaAlter.state_dict()`` holds beside ``torch.optim``'s, and whether it can load, decided
before anything changes.

A Local AdaAlter checkpoint (Xie et al. 2019, arXiv 1911.09030) holds, beside
the accumulators, the schedule, two counters, the world size and rank that
saved it and, with an outer optimizer, its anchor and velocity
(:func:`add_extra_state`). :func:`load_checked` first calls
:func:`check_loadable`, which raises ``ValueError`` naming what differs
and what to do, so that a refused state leaves the optimizer as it was:

* a state saved between two averagings (``step != last_sync``) holds that
  rank's own local accumulators: it loads only on the same rank of the same
  number of ranks; a state saved at an averaging loads anywhere;
* accumulators shaped unlike the parameters come from another model;
* every saved parameter group names a known lazy correction (or a bool, as
  states saved before the rules had names);
* the schedule's warm-up and period are this optimizer's;
* outer optimizer: present in both or in neither, of the same kind
  (OuterSGD or a ``torch.optim`` optimizer), with the same options and
  shapes (a state saved without one loads into an optimizer with one, which
  then starts from where the next round begins);
* the accumulators' period is this optimizer's; with it longer than the
  period, a state saved at a synchronisation that did not average them holds
  this rank's own accumulators, like one saved between synchronisations;
* a sparse synchronisation's residuals belong to the rank that saved them:
  such a state loads only on that rank of the same number of ranks.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional

import torch

from .._internal.collectives import world_size_and_rank
from .lazy_correction import check_rule
from .outer_sgd import OuterSGD
from .schedule import LocalAdaAlterSchedule

__all__ = ["add_extra_state", "load_checked", "check_loadable"]

logger = logging.getLogger(__name__)


def add_extra_state(state_dict: Dict[str, Any], opt: torch.optim.Optimizer) -> Dict[str, Any]:
    """``state_dict`` (``torch.optim``'s state of the ``LocalAdaAlter`` ``opt``) with the schedule, the counters
    ``amp_agreements`` and ``averagings``, the ``world_size`` and ``rank`` that saved it, and the outer
    optimizer's state if ``opt`` has one."""
    state_dict["schedule"] = opt.schedule.state_dict()
    state_dict["amp_agreements"] = opt.amp_agreements
    state_dict["averagings"] = opt.averager.averagings
    state_dict["world_size"], state_dict["rank"] = world_size_and_rank(opt.process_group)
    state_dict["accumulator_period"] = opt.accumulator_period
    if opt.averager.outer is not None:
        state_dict["outer"] = opt.averager.outer.state_dict()
    if opt.averager.sparse is not None:
        state_dict["sparse"] = opt.averager.sparse.state_dict(opt.process_group)
    return state_dict


def load_checked(opt: torch.optim.Optimizer, state_dict: Dict[str, Any],
                 load_base: Callable[[Dict[str, Any]], None]) -> None:
    """Load into the ``LocalAdaAlter`` ``opt`` a state that :func:`add_extra_state` completed, if
    :func:`check_loadable` accepts it; ``load_base`` is ``torch.optim``'s ``load_state_dict`` for the rest."""
    outer = opt.averager.outer
    params = [p for g in opt.param_groups for p in g["params"]]
    world_size, rank = world_size_and_rank(opt.process_group)
    sparse = opt.averager.sparse
    if ("sparse" in state_dict) != (sparse is not None):
        saved, mine = ("with" if "sparse" in state_dict else "without"), ("has one" if sparse else "has none")
        raise ValueError(f"this LocalAdaAlter state was saved {saved} a sparse synchronisation and this optimizer "
                         f"{mine}; build it as it was saved to resume")
    if sparse is not None:  # (first: its residuals make every state this rank's own)
        sparse.check_loadable(state_dict["sparse"], params, opt.process_group)
    check_loadable(state_dict, params=params, world_size=world_size, rank=rank, schedule=opt.schedule, outer=outer,
                   accumulator_period=opt.accumulator_period)
    state_dict = dict(state_dict)
    sparse_state = state_dict.pop("sparse", None)
    state_dict.pop("accumulator_period", None)
    state_dict.pop("world_size", None)
    state_dict.pop("rank", None)
    schedule = state_dict.pop("schedule")
    outer_state = state_dict.pop("outer", None)
    if outer is not None and outer_state is None:
        logger.warning("LocalAdaAlter: the state holds no outer optimizer (saved without one); the outer "
                       "optimizer starts from where the next round begins")
    amp_agreements = int(state_dict.pop("amp_agreements", 0))
    averagings = int(state_dict.pop("averagings", 0))
    load_base(state_dict)
    for group in opt.param_groups:  # states saved before the rules had names hold a bool
        group["lazy_correction"] = check_rule(group["lazy_correction"])
    opt.schedule.load_state_dict(schedule)
    if outer is not None:
        if outer_state is None:
            outer.anchors = None
            if isinstance(outer, OuterSGD):
                outer.velocities = None
        else:
            outer.load_state_dict(outer_state, params)
    if sparse is not None:
        sparse.load_state_dict(sparse_state, params, opt.process_group)
    opt.amp_agreements, opt.averager.averagings = amp_agreements, averagings


def check_loadable(state_dict: Dict[str, Any], *, params: List[torch.Tensor], world_size: int, rank: int,
                   schedule: LocalAdaAlterSchedule, outer, accumulator_period: Optional[int] = None) -> None:
    """Raise ``ValueError`` unless ``state_dict`` loads into an optimizer over ``params`` with ``schedule``,
    ``outer`` (an OuterSGD or OuterOptimizer) and ``accumulator_period``, on ``rank`` of ``world_size``."""
    if "schedule" not in state_dict:
        raise ValueError("this state dict has no 'schedule' entry; it was not saved by LocalAdaAlter.state_dict()")
    sched = state_dict["schedule"]
    saved_world, saved_rank = state_dict.get("world_size"), state_dict.get("rank")
    step, warmup = int(sched["step"]), int(sched["warmup_steps"])
    saved_period = int(state_dict.get("accumulator_period") or sched["period"] or 1)  # (saved before: the period)
    own_accumulators = step > warmup and (step != int(sched["last_sync"]) or (step - warmup) % saved_period != 0)
    if accumulator_period is not None and saved_period != accumulator_period and \
            (own_accumulators or (step > warmup and (step - warmup) % accumulator_period != 0)):
        raise ValueError(f"this LocalAdaAlter state averages its accumulators every {saved_period} steps and this "
                         f"optimizer every {accumulator_period} (`accumulator_period`), and it was saved at step "
                         f"{step}, where the two differ on what the local accumulators hold; build it as it was "
                         "saved, or resume from a step where both averaged them")
    if saved_world is not None and own_accumulators and (saved_world, saved_rank) != (world_size, rank):
        raise ValueError(
            f"this LocalAdaAlter state was saved by rank {saved_rank} of {saved_world} between two averagings of its "
            f"accumulators (step {step}, last synchronised at {sched['last_sync']}), and this is rank {rank} of "
            f"{world_size}: "
            "its local accumulators belong to that rank alone "
            f"(they are averaged every {saved_period} steps after the warm-up). Resume on the same ranks, or from a "
            "checkpoint taken at a step that averaged them, which loads on any number of ranks"
        )
    saved_ids = [i for g in state_dict.get("param_groups", []) for i in g["params"]]
    for i, p in zip(saved_ids, params):
        for name, t in state_dict.get("state", {}).get(i, {}).items():
            if isinstance(t, torch.Tensor) and t.shape != p.shape:
                raise ValueError(
                    f"the saved LocalAdaAlter state {name!r} of parameter #{i} has shape {tuple(t.shape)} but the "
                    f"parameter has shape {tuple(p.shape)}: the state was saved from a different model"
                )
    for i, group in enumerate(state_dict.get("param_groups", [])):
        try:
            check_rule(group.get("lazy_correction", "paper"))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"the saved param group {i} has an unknown lazy correction: {exc}") from None
    LocalAdaAlterSchedule(warmup_steps=schedule.warmup_steps, period=schedule.period).load_state_dict(sched)  # a copy
    outer_state = state_dict.get("outer")
    if outer_state is not None and outer is None:
        raise ValueError(
            f"this LocalAdaAlter state was saved with an outer optimizer ({_outer_kind(outer_state)}) and this "
            "optimizer has none; build it with the saved outer optimizer to resume"
        )
    if outer is not None and outer_state is not None:
        outer.check_loadable(outer_state, params)  # kind, options and shapes, on a copy


def _outer_kind(outer_state: Dict[str, Any]) -> str:
    if "optimizer" in outer_state:
        return f"a torch.optim {outer_state.get('kind', 'optimizer')}"
    return f"outer_lr={outer_state['lr']}, outer_momentum={outer_state['momentum']}"

"""Whether a ``LocalAdaAlter.state_dict()`` can load into an optimizer, decided before anything changes.

A Local AdaAlter checkpoint (Xie et al. 2019, arXiv 1911.09030) holds, beside
the accumulators, the schedule and, with an outer optimizer, its anchor and
velocity. :func:`check_loadable` raises ``ValueError`` naming what differs
and what to do, so that a refused state leaves the optimizer as it was:

* a state saved between two averagings (``step != last_sync``) holds that
  rank's own local accumulators: it loads only on the same rank of the same
  number of ranks; a state saved at an averaging loads anywhere;
* accumulators shaped unlike the parameters come from another model;
* every saved parameter group names a known lazy correction (or a bool, as
  states saved before the rules had names);
* the schedule's warm-up and period are this optimizer's;
* outer optimizer: present in both or in neither, with the same options and
  shapes (a state saved without one loads into an optimizer with one, which
  then starts at the next averaging).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from .lazy_correction import check_rule
from .outer_sgd import OuterSGD
from .schedule import LocalAdaAlterSchedule

__all__ = ["check_loadable"]


def check_loadable(state_dict: Dict[str, Any], params: List[torch.Tensor], world_size: int, rank: int,
                   schedule: LocalAdaAlterSchedule, outer: Optional[OuterSGD]) -> None:
    """Raise ``ValueError`` unless ``state_dict`` loads into an optimizer over ``params`` with ``schedule``
    and ``outer``, on ``rank`` of ``world_size``."""
    if "schedule" not in state_dict:
        raise ValueError("this state dict has no 'schedule' entry; it was not saved by LocalAdaAlter.state_dict()")
    sched = state_dict["schedule"]
    saved_world, saved_rank = state_dict.get("world_size"), state_dict.get("rank")
    if saved_world is not None and int(sched["step"]) != int(sched["last_sync"]) and \
            (saved_world, saved_rank) != (world_size, rank):
        raise ValueError(
            f"this LocalAdaAlter state was saved by rank {saved_rank} of {saved_world} between two averagings "
            f"(step {sched['step']}, last averaged at {sched['last_sync']}), and this is rank {rank} of {world_size}: "
            "its local accumulators belong to that rank alone. Resume on the same ranks, or from a checkpoint "
            "taken at an averaging step (step == last_sync), which loads on any number of ranks"
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
    LocalAdaAlterSchedule(schedule.warmup_steps, schedule.period).load_state_dict(sched)  # on a copy
    outer_state = state_dict.get("outer")
    if outer_state is not None and outer is None:
        raise ValueError(
            f"this LocalAdaAlter state was saved with an outer optimizer (outer_lr={outer_state['lr']}, "
            f"outer_momentum={outer_state['momentum']}) and this optimizer has none; build it with the saved "
            "outer_lr and outer_momentum to resume"
        )
    if outer is not None and outer_state is not None:
        OuterSGD(outer.lr, outer.momentum, outer.nesterov).load_state_dict(outer_state, params)  # on a copy

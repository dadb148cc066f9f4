"""Saving and loading a :class:`~ddp_hooks.SparsifyState`: this rank's state, as tensors and ints only.

A state dict holds the step, the options as ints
(:meth:`~.options.SparsifyOptions.config_ints`: explicit codes, floats as
their bits), the rank and world size it was saved on, this rank's residuals,
velocities and last update per parameter key, the optimizers' momenta and
the counters. It loads with ``torch.load(..., weights_only=True)``.

Loading refuses other options, and at the first step another rank, another
world size, or another model's parameters (:func:`check_loaded_rank`,
:func:`check_loaded_keys`). States saved by older versions still load: the
options added since are filled with the values those states imply.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Dict, NamedTuple, Optional, Set

from .._internal.codec import float_to_bits
from .._internal.validation import check_int
from .memory import NonfiniteSteps
from .options import SparsifyOptions

__all__ = ["Loaded", "state_dict_of", "load_into", "check_loaded_rank", "check_loaded_keys"]

logger = logging.getLogger("ddp_hooks.sparsify.state")

STATE_VERSION = 1
# Options added after version 1 states were first saved, with the values those states imply.
CONFIG_ADDED_LATER = {"momentum_bits": float_to_bits(0.0), "weight_decay_bits": float_to_bits(0.0),
                      "density_warmup_steps": 0, "error_feedback_beta_bits": float_to_bits(1.0),
                      "value_dtype": 0, "density_warmup_start_bits": float_to_bits(1.0)}
# Options added later still (issue 16) that change which entries are sent or how the result is
# presented, not what the residuals mean: a state saved without them resumes under any value.
CONFIG_FREE_IF_ABSENT = ("block_size", "optimizer_momentum")
# Options that only some selectors read (their ``own_options``).
SELECTOR_OPTIONS = ("block_size",)
REQUIRED = {"version", "step", "config", "rank", "world_size", "residuals", "stats"}


class Loaded(NamedTuple):
    """What a load leaves to check at the first step: the rank and world size saved, the keys of its residuals."""

    rank: int
    world_size: int
    keys: Optional[Set[int]]  # None once checked
    ranks_per_node: int = 0  # 0: saved by a flat exchange
    local_rank: int = 0  # with nodes: which piece of every parameter the residuals are


def state_dict_of(state) -> Dict[str, Any]:
    """``state.state_dict()``: see :meth:`ddp_hooks.SparsifyState.state_dict`."""
    if state.run is not None and state.run.busy:
        raise RuntimeError("state_dict() was called in the middle of a backward pass")
    where = state.binding or state.loaded
    return {
        "version": STATE_VERSION,
        "step": state.step,
        "config": state.options.config_ints(),
        "rank": 0 if where is None else where.rank,
        "world_size": 1 if where is None else where.world_size,
        # with nodes, residuals are this rank's piece of each parameter: piece local_rank of ranks_per_node
        "ranks_per_node": _piece(state)[0],
        "local_rank": _piece(state)[1],
        "residuals": state.residuals.state() if state.options.error_feedback else {},
        "velocities": state.velocities.state() if state.runs_velocity else {},
        "stats": state.counters.state_dict(),
        "nonfinite_steps": int(state.nonfinite),
        "last_updates": state.last_updates.state(),
        "optimizer_momenta": state.momenta.state(),
    }


def load_into(state, state_dict: Dict[str, Any], *, residuals: bool = True) -> None:
    """``state.load_state_dict(state_dict, residuals)``: see :meth:`ddp_hooks.SparsifyState.load_state_dict`."""
    if not isinstance(state_dict, dict):
        raise TypeError(f"`state_dict` must be a dict from SparsifyState.state_dict(), got {type(state_dict).__name__}")
    missing = REQUIRED - set(state_dict)
    if missing:
        raise ValueError(f"`state_dict` lacks {sorted(missing)}: it is not a SparsifyState.state_dict()")
    if state_dict["version"] != STATE_VERSION:
        raise ValueError(f"hook state version {state_dict['version']!r} is not supported (expected {STATE_VERSION})")
    absent = [name for name in CONFIG_FREE_IF_ABSENT if name not in state_dict["config"]]
    saved, mine = {**CONFIG_ADDED_LATER, **state_dict["config"]}, state.options.config_ints()
    if absent:
        logger.warning("SparsifyState: the hook state was saved before %s existed; it resumes with %s",
                       ", ".join(absent), ", ".join(f"{name}={getattr(state.options, name)!r}" for name in absent))
        saved.update({name: mine[name] for name in absent})
    # an option of another selector's (block_size for top-k) changes nothing here: a random-k state saved
    # when block_size defaulted to 16 resumes under today's default
    saved.update({name: mine[name] for name in SELECTOR_OPTIONS
                  if name not in state.options.selector.own_options and saved["method"] == mine["method"]})
    if saved != mine:
        differ = sorted(re.sub(r"_(e9|bits)$", "", name) for name in mine if saved.get(name) != mine[name])
        hint = " (random_block's default block_size was 16 before it became 4)" if "block_size" in differ else ""
        raise ValueError(
            f"the hook state was saved with other options (differing: {', '.join(differ)}): saved with "
            f"{SparsifyOptions.describe(saved)} but this SparsifyState has {SparsifyOptions.describe(mine)}; "
            f"build the state with the saved options to resume{hint}"
        )
    check_int("state_dict['step']", state_dict["step"], 0)
    state.step = state_dict["step"]
    state.counters.load_state_dict(state_dict["stats"])
    # (nonfinite_steps is absent in states saved before it was counted)
    state.nonfinite = NonfiniteSteps(check_int("nonfinite_steps", state_dict.get("nonfinite_steps", 0), 0))
    state.residuals.load(state_dict["residuals"] if residuals else {})
    state.velocities.load(state_dict.get("velocities", {}) if residuals else {})
    state.last_updates.load(state_dict.get("last_updates", {}) if residuals else {})
    state.momenta.load(state_dict.get("optimizer_momenta", {}))
    if not state.runs_velocity:
        state.velocities.load({})
    state.layouts.forget_buckets()
    state.loaded = None
    if residuals:
        state.loaded = Loaded(rank=state_dict["rank"], world_size=state_dict["world_size"],
                              keys={int(k) for k in state_dict["residuals"]},
                              ranks_per_node=state_dict.get("ranks_per_node", 0),
                              local_rank=state_dict.get("local_rank", 0))
    if state.binding is not None:
        check_loaded_rank(state)


def check_loaded_rank(state) -> None:
    """At binding (or at a load after it): the loaded residuals were saved by this rank of this world size."""
    loaded, binding = state.loaded, state.binding
    if loaded is None:
        return
    if loaded.world_size != binding.world_size:
        raise ValueError(
            f"the hook state was saved on {loaded.world_size} ranks but this run has {binding.world_size}: "
            "error-feedback residuals belong to one rank each and cannot be redistributed; "
            "resume on the same number of ranks, or drop the residuals with load_state_dict(sd, "
            "residuals=False)"
        )
    if loaded.rank != binding.rank:
        raise ValueError(f"rank {binding.rank} loaded the hook state saved by rank {loaded.rank}: "
                         "each rank must load its own file, since residuals differ per rank")
    if (loaded.ranks_per_node, loaded.local_rank) != _piece(state):
        def nodes(size, local_rank):
            return "a flat exchange (nodes=None)" if not size else \
                f"nodes of {size} ranks, this rank {local_rank} in its node"

        raise ValueError(
            f"the hook state was saved with {nodes(loaded.ranks_per_node, loaded.local_rank)} but this run has "
            f"{nodes(*_piece(state))}: with nodes each rank keeps the residuals of its own piece of every "
            "parameter, cut by the ranks per node and chosen by its place in the node; resume with the same "
            "nodes, or drop the residuals with load_state_dict(sd, residuals=False)"
        )


def check_loaded_keys(state, compressed: bool) -> None:
    """At the end of a step: every loaded residual found its parameter, and (once) every parameter its residual."""
    for what, store in (("residuals", state.residuals), ("velocities", state.velocities)):
        if store.pending_keys:
            raise ValueError(
                f"the loaded hook state holds {what} for parameters {store.pending_keys} that this "
                "model does not have: the state was saved from a different model"
            )
    loaded = state.loaded
    if compressed and loaded is not None and loaded.keys is not None:
        extra = sorted(set(state.layouts.keys.values()) - loaded.keys) if loaded.keys else []
        if extra:
            raise ValueError(
                f"this model has parameters {extra} for which the loaded hook state holds no residual: "
                "the state was saved from a different model"
            )
        state.loaded = loaded._replace(keys=None)  # checked once, at the first compressed step after loading


def _piece(state) -> tuple:
    """``(L, j)``: with nodes, piece ``j`` of ``L`` of every parameter is this rank's ((0, 0): flat), as bound,
    or as loaded before binding."""
    if state.binding is not None:
        nodes = state.binding.nodes
        if nodes is None or nodes.size == 1:  # (one rank per node: the flat layout)
            return 0, 0
        return nodes.size, nodes.local_rank
    return (0, 0) if state.loaded is None else (state.loaded.ranks_per_node, state.loaded.local_rank)

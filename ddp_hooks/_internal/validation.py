"""Argument checks shared by the package's constructors.

Each check raises with the argument's name, the value received, the rule, and
why the rule exists, e.g.::

    ValueError: `density` must be a float in (0, 1], got 1.5; it is the fraction
    of gradient entries each rank sends per step
"""

from __future__ import annotations

import math
from typing import Iterable


def _why(reason: str) -> str:
    return f"; {reason}" if reason else ""


def check_choice(name: str, value, choices: Iterable[str], reason: str = "") -> str:
    choices = tuple(choices)
    if not isinstance(value, str) or value not in choices:
        raise ValueError(
            f"`{name}` must be one of {', '.join(repr(c) for c in choices)}, got {value!r}{_why(reason)}"
        )
    return value


def check_bool(name: str, value, reason: str = "") -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be a bool, got {value!r} of type {type(value).__name__}{_why(reason)}")
    return value


def check_int(name: str, value, minimum: int, reason: str = "", maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`{name}` must be an int, got {value!r} of type {type(value).__name__}{_why(reason)}")
    if value < minimum or (maximum is not None and value > maximum):
        rule = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"`{name}` must be an int {rule}, got {value}{_why(reason)}")
    return value


def check_float(
    name: str,
    value,
    low: float,
    high: float,
    low_open: bool = False,
    high_open: bool = False,
    reason: str = "",
) -> float:
    """Check low (<|<=) value (<|<=) high; ints are accepted, bools and NaN are not."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"`{name}` must be a float, got {value!r} of type {type(value).__name__}{_why(reason)}")
    value = float(value)
    too_low = value <= low if low_open else value < low
    too_high = value >= high if high_open else value > high
    if math.isnan(value) or too_low or too_high:
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise ValueError(f"`{name}` must be a float in {interval}, got {value!r}{_why(reason)}")
    return value


def check_process_group(name: str, value) -> None:
    """None (the default group) or a ``torch.distributed.ProcessGroup``."""
    if value is None:
        return
    import torch.distributed as dist

    if not isinstance(value, dist.ProcessGroup):
        raise TypeError(
            f"`{name}` must be None (the default group) or a torch.distributed.ProcessGroup, "
            f"got {value!r} of type {type(value).__name__}"
        )


def check_hook_call(hook: str, state, state_type: type, bucket) -> None:
    """A comm hook's arguments: the state it was registered with, and a DDP ``GradBucket``.

    Catches ``register_comm_hook(None, hook)``, registering a DDP hook with
    FSDP, whose hooks receive a gradient tensor instead of a bucket, and DDP
    built in the ``python_reducer`` mode, which calls hooks with ``(grad, param)``.
    """
    import torch.distributed as dist

    if not isinstance(state, state_type):
        raise TypeError(
            f"{hook} was registered with a state of type {type(state).__name__}; it needs a {state_type.__name__}: "
            f"ddp_model.register_comm_hook({state_type.__name__}(...), {hook})"
        )
    if isinstance(bucket, tuple) and len(bucket) == 2:
        raise TypeError(
            f"{hook} received (grad, param) instead of a torch.distributed.GradBucket: DistributedDataParallel "
            "was built while torch._dynamo.config.optimize_ddp was 'python_reducer' (the mode for compiled "
            "autograd), in which it calls comm hooks once per parameter, and this hook compresses whole buckets. "
            "Build DDP with optimize_ddp at its default (True); DistributedDataParallel(torch.compile(model)) "
            "then compiles the model and keeps the hook"
        )
    if not isinstance(bucket, dist.GradBucket):
        raise TypeError(
            f"{hook} received a {type(bucket).__name__} instead of a torch.distributed.GradBucket: it is a "
            "DistributedDataParallel comm hook; register it with DistributedDataParallel.register_comm_hook "
            "(FSDP comm hooks have another signature)"
        )


def _served_device_types(group) -> set:
    """Device types the group's backend moves, from ``get_backend_config`` (e.g. 'cpu:gloo,cuda:nccl')."""
    import torch.distributed as dist

    get_config = getattr(dist, "get_backend_config", None)
    if get_config is None:  # older torch: only the backend's name
        return {"cuda"} if str(dist.get_backend(group)) == "nccl" else set()
    served = set()
    for part in str(get_config(group)).split(","):
        device, _, backend = part.partition(":")
        if backend:
            served.add(device.strip())
    return served


def check_group_ready(process_group, device, hook: str):
    """The group a hook communicates in, checked once at its first call; returns it.

    Raises ``RuntimeError`` when no process group exists yet, and when the
    group's backend does not move tensors of the gradients' device type
    (e.g. NCCL with CPU gradients), instead of failing deep inside a collective.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{hook} was called but torch.distributed has no process group; "
                           "call torch.distributed.init_process_group before training")
    group = process_group if process_group is not None else dist.group.WORLD
    served = _served_device_types(group)
    if served and device.type not in served:
        config = getattr(dist, "get_backend_config", dist.get_backend)(group)
        raise RuntimeError(
            f"{hook}: the gradients are on {device.type} but the process group's backend ({config!r}) only moves "
            f"{', '.join(sorted(served))} tensors; use a group whose backend serves {device.type} "
            "(gloo for CPU, nccl for CUDA)"
        )
    return group

"""Communication hooks and optimizers of the CIFAR recipe, built from its flags.

:class:`Exchange` wraps the chosen DDP comm hook: it registers it once,
times the hook function, counts the payload bytes each rank hands to its
collectives, and saves and restores the hook's state as a plain dict (so a
checkpoint loads with ``torch.load(weights_only=True)``).

Bytes are *payload per rank*: what this rank contributes to its collectives.
A ring all-reduce moves about ``2 (W-1)/W`` times that per rank over the
wire, an all-gather ``W-1`` times. PyTorch's hooks report nothing, so the
recipe counts for them: allreduce sends the bucket (``numel * element
size``), fp16 half of it, PowerSGD its P and Q factors plus the tensors it
leaves uncompressed (from ``PowerSGDState``'s element counters, or the full
bucket during its dense warm-up). The ``ddp_hooks`` states count their own
(``stats()["bytes_sent"]``).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks, default_hooks, powerSGD_hook

__all__ = ["HOOKS", "BENCH_HOOKS", "OPTIMIZERS", "SYNC_SELECTORS", "Exchange", "build_exchange", "build_optimizer",
           "hook_warmup_steps"]

HOOKS = ("allreduce", "fp16", "powersgd", "sparsify", "local_sgd")
# Hooks for benchmarks only, under which each rank trains on its own gradients and the replicas drift apart:
# PyTorch's noop_hook exchanges nothing, the ceiling no hook can beat; "barrier" adds one 4-byte allreduce per
# bucket, the cost of keeping the ranks in step alone (latency, waiting for the slowest rank).
BENCH_HOOKS = ("noop", "barrier")
OPTIMIZERS = ("sgd", "adagrad", "local_adaalter")
#: local_adaalter's sparse synchronisations (--sync): the selectors that send pseudo-gradients
SYNC_SELECTORS = ("random_block", "shared_topk", "topk", "randomk")


def hook_warmup_steps(args) -> int:
    """Dense steps before the hook compresses (``--warmup-steps``, or the hook's default)."""
    if args.warmup_steps is not None:
        return args.warmup_steps
    # PowerSGD with error feedback cannot start before step 2: DDP rebuilds
    # its buckets after the first step.
    return 2 if args.hook == "powersgd" else 0


class Exchange:
    """A registered comm hook with timing, byte counters and a plain-dict state.

    Args:
        kind (str): one of :data:`HOOKS`.
        state: the hook's state object (``None`` for the stateless hooks).
        hook: the hook function ``hook(state, bucket) -> Future``.
        sent_counter: ``state -> cumulative bytes sent`` for hooks that count
            their own, else ``None``.
        bucket_bytes: ``(state, bucket, counter_delta) -> bytes sent`` for the
            hooks the recipe counts for.
    """

    def __init__(self, kind: str, state: Any, hook: Callable, sent_counter=None, bucket_bytes=None):
        self.kind = kind
        self.state = state
        self._hook = hook
        self._sent_counter = sent_counter
        self._bucket_bytes = bucket_bytes
        self.hook_seconds = 0.0
        self.last_call_end = 0.0  # perf_counter() when the latest hook call returned (the cluster bench reads it)
        self.bytes_dense = 0
        self._bytes_counted = 0  # bytes the recipe counted itself (PyTorch's hooks)
        self._registered = False

    # ----- the hook -----
    def wrap_hook(self, wrapper: Callable[[Callable], Callable]) -> None:
        """Replace the hook by ``wrapper(hook)`` (before :meth:`register`); timing and counting stay outside it."""
        if self._registered:
            raise RuntimeError("wrap the hook before Exchange.register()")
        self._hook = wrapper(self._hook)

    def register(self, ddp_model) -> None:
        """Register the timed hook; DDP allows this once per model, so load state first."""
        if self._registered:
            raise RuntimeError("Exchange.register() was already called: DDP takes one comm hook per model")
        ddp_model.register_comm_hook(self.state, self._timed_hook())
        self._registered = True

    def _timed_hook(self):
        inner, exchange = self._hook, self

        def timed_hook(state, bucket):
            before = exchange._powersgd_numel()
            start = time.perf_counter()
            fut = inner(state, bucket)
            exchange.last_call_end = time.perf_counter()
            exchange.hook_seconds += exchange.last_call_end - start
            buffer = bucket.buffer()
            exchange.bytes_dense += buffer.numel() * buffer.element_size()
            if exchange._bucket_bytes is not None:
                exchange._bytes_counted += exchange._bucket_bytes(bucket, exchange._powersgd_numel() - before)
            return fut

        return timed_hook

    def _powersgd_numel(self) -> int:
        if self.kind == "powersgd":
            return self.state.total_numel_after_compression
        if self.kind == "local_sgd":
            return self.state.allreduce_calls
        return 0

    def count_averaging(self, optimizer) -> None:
        """Count LocalAdaAlter's model averaging (parameters and accumulators; with a sparse synchronisation
        what its compressors sent) as bytes sent."""
        averager, exchange = optimizer.averager, self
        average_ = averager.average_

        def counted_average_(tensors):
            exchange._bytes_counted += sum(t.numel() * t.element_size() for t in tensors)
            return average_(tensors)

        averager.average_ = counted_average_
        sparse = averager.sparse
        if sparse is None:
            return

        def sent():
            return sum(counters.bytes_sent for counters in sparse.counters.values())

        for name in ("average_", "mean_accumulators_"):
            def counted(*args, _exchange_=getattr(sparse, name), **kwargs):
                before = sent()
                try:
                    return _exchange_(*args, **kwargs)
                finally:
                    exchange._bytes_counted += sent() - before
            setattr(sparse, name, counted)

    @property
    def bytes_sent(self) -> int:
        """Payload bytes this rank has sent since the start of training (restored on resume)."""
        if self._sent_counter is not None:
            return int(self._sent_counter(self.state))
        return self._bytes_counted

    # ----- checkpoints -----
    def state_dict(self) -> Dict[str, Any]:
        sd: Dict[str, Any] = {"kind": self.kind, "bytes_dense": self.bytes_dense,
                              "bytes_counted": self._bytes_counted, "hook_seconds": self.hook_seconds}
        if self.kind == "powersgd":
            sd["state"] = _powersgd_state_dict(self.state)
        elif self.state is not None and hasattr(self.state, "state_dict"):
            sd["state"] = self.state.state_dict()
        return sd

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        if sd["kind"] != self.kind:
            raise ValueError(f"the checkpoint's hook state is for --hook {sd['kind']}, this run has --hook {self.kind}")
        if self._registered:
            raise RuntimeError("load the hook state before Exchange.register(), so the first step uses it")
        self.bytes_dense, self._bytes_counted = sd["bytes_dense"], sd["bytes_counted"]
        self.hook_seconds = sd["hook_seconds"]
        if self.kind == "powersgd":
            _powersgd_load_state_dict(self.state, sd["state"])
        elif "state" in sd:
            self.state.load_state_dict(sd["state"])


# ----- PowerSGDState <-> plain dict (its own pickling keeps a numpy RandomState) -----
def _powersgd_state_dict(state: powerSGD_hook.PowerSGDState) -> Dict[str, Any]:
    name, keys, pos, has_gauss, gauss = state.rng.get_state()
    return {
        "iter": state.iter,
        "error_dict": dict(state.error_dict),
        "p_memory_dict": dict(state.p_memory_dict),
        "q_memory_dict": dict(state.q_memory_dict),
        "rng_keys": torch.from_numpy(keys.astype(np.int64)),
        "rng_pos": int(pos), "rng_has_gauss": int(has_gauss), "rng_gauss": float(gauss),
        "total_numel_before_compression": state.total_numel_before_compression,
        "total_numel_after_compression": state.total_numel_after_compression,
    }


def _powersgd_load_state_dict(state: powerSGD_hook.PowerSGDState, sd: Dict[str, Any]) -> None:
    state.iter = sd["iter"]
    state.error_dict = {k: v.clone() for k, v in sd["error_dict"].items()}
    state.p_memory_dict = {k: v.clone() for k, v in sd["p_memory_dict"].items()}
    state.q_memory_dict = {k: v.clone() for k, v in sd["q_memory_dict"].items()}
    keys = sd["rng_keys"].numpy().astype(np.uint32)
    state.rng.set_state(("MT19937", keys, sd["rng_pos"], sd["rng_has_gauss"], sd["rng_gauss"]))
    state.total_numel_before_compression = sd["total_numel_before_compression"]
    state.total_numel_after_compression = sd["total_numel_after_compression"]


def _bucket_nbytes(bucket, ratio: float = 1.0) -> int:
    buffer = bucket.buffer()
    return int(buffer.numel() * buffer.element_size() * ratio)


def barrier_hook(process_group, bucket) -> torch.futures.Future:
    """Allreduce one float per bucket and leave the gradients as they are (benchmarks only, see BENCH_HOOKS)."""
    token = torch.zeros(1, device=bucket.buffer().device)
    fut = dist.all_reduce(token, group=process_group, async_op=True).get_future()
    buffer = bucket.buffer()
    return fut.then(lambda _: buffer)


def build_exchange(args, process_group: Optional[dist.ProcessGroup] = None, grad_scaler=None) -> Exchange:
    """The comm hook of ``args.hook`` with its state, wrapped in an :class:`Exchange`.

    ``grad_scaler``: the AMP scaler, given to the sparsifier so that its residuals stay unscaled.
    """
    warmup = hook_warmup_steps(args)
    if args.hook == "allreduce":
        return Exchange("allreduce", process_group, default_hooks.allreduce_hook,
                        bucket_bytes=lambda bucket, _: _bucket_nbytes(bucket))
    if args.hook == "noop":
        return Exchange("noop", process_group, debugging_hooks.noop_hook, bucket_bytes=lambda bucket, _: 0)
    if args.hook == "barrier":
        return Exchange("barrier", process_group, barrier_hook, bucket_bytes=lambda bucket, _: 4)
    if args.hook == "fp16":
        return Exchange("fp16", process_group, default_hooks.fp16_compress_hook,
                        bucket_bytes=lambda bucket, _: _bucket_nbytes(bucket, 2 / bucket.buffer().element_size()))
    if args.hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=process_group, matrix_approximation_rank=args.powersgd_rank,
            start_powerSGD_iter=warmup, random_seed=args.hook_seed,
            # its own INFO report is replaced by the recipe's progress line
            compression_stats_logging_frequency=1 << 62,
        )
        # Counter delta > 0: the hook compressed and counted P, Q and the
        # uncompressed tensors; 0: it was a plain allreduce of the bucket.
        return Exchange("powersgd", state, powerSGD_hook.powerSGD_hook, bucket_bytes=lambda bucket, delta: (
            delta * bucket.buffer().element_size() if delta > 0 else _bucket_nbytes(bucket)))
    if args.hook == "sparsify":
        from ddp_hooks import SparsifyState, sparsify_hook

        # build_optimizer pairs SGD with this state as ddp_hooks.build_sparsify_sgd does (paired_sgd).
        state = SparsifyState(
            process_group=process_group, method=args.method, density=args.density, scope=args.scope,
            aggregation=args.aggregation, error_feedback=not args.no_error_feedback,
            warmup_steps=warmup, seed=args.hook_seed, grad_scaler=grad_scaler, block_size=args.block_size,
            density_warmup_steps=args.density_warmup_steps,
            density_warmup_start=getattr(args, "density_warmup_start", None), value_dtype=args.value_dtype,
            nodes=getattr(args, "nodes", None),
        )
        return Exchange("sparsify", state, sparsify_hook, sent_counter=lambda s: s.stats()["bytes_sent"])
    if args.hook == "local_sgd":
        from ddp_hooks import LocalSGDState, local_sgd_hook

        state = LocalSGDState(process_group=process_group, warmup_steps=warmup)
        # The hook allreduces the bucket in warm-up (its call counter moves) and sends nothing after;
        # build_optimizer shares the schedule with LocalAdaAlter, whose averaging count_averaging counts.
        return Exchange("local_sgd", state, local_sgd_hook, bucket_bytes=lambda bucket, delta: (
            _bucket_nbytes(bucket) if delta > 0 else 0))
    raise ValueError(f"unknown hook {args.hook!r}; choose one of {', '.join(HOOKS)} (benchmarks also take "
                     f"{', '.join(BENCH_HOOKS)})")


def build_optimizer(args, params, exchange: Optional[Exchange] = None,
                    process_group: Optional[dist.ProcessGroup] = None) -> torch.optim.Optimizer:
    """The optimizer of ``args.optimizer`` over ``params`` (local_adaalter: sharing ``exchange``'s schedule)."""
    params = list(params)
    if args.optimizer == "sgd" and exchange is not None and exchange.kind == "sparsify":
        from ddp_hooks.sparsify.optimizer import paired_sgd  # the pairing rule of build_sparsify_sgd

        return paired_sgd(exchange.state, params, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    if args.optimizer == "sgd":
        return torch.optim.SGD(params, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    if args.optimizer == "adagrad":
        return torch.optim.Adagrad(params, lr=args.lr, eps=args.eps, weight_decay=args.weight_decay)
    if args.optimizer == "local_adaalter":
        from ddp_hooks import LocalAdaAlter, SparseAverage

        # Not ddp_hooks.build_local_adaalter: it registers the hook at once, and the recipe
        # registers only after loading a checkpoint and settling DDP's buckets.
        rule = {} if args.lazy_correction is None else {"lazy_correction": args.lazy_correction}
        sync = getattr(args, "sync", None) or "dense"
        sparse = None if sync == "dense" else SparseAverage(method=sync, density=args.sync_density)
        opt = LocalAdaAlter(params, lr=args.lr, eps=args.eps, period=args.period,
                            warmup_steps=hook_warmup_steps(args), process_group=process_group,
                            hook_state=exchange.state if exchange is not None else None,
                            outer_lr=args.outer_lr, outer_momentum=args.outer_momentum, sparse=sparse,
                            accumulator_period=getattr(args, "accumulator_period", None) or None,
                            compress_accumulators=bool(getattr(args, "compress_accumulators", False)), **rule)
        if exchange is not None:
            exchange.count_averaging(opt)
        return opt
    raise ValueError(f"unknown optimizer {args.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")

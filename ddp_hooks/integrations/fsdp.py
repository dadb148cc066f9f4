r"""FSDP2's replicas: the all-reduce between replicas of a shard through the sparsifying compressor.

HSDP shards a model over the ranks of a node (the *shard* dimension of a 2-D
mesh) and replicates it across nodes (the *replicate* dimension): each
gradient is reduce-scattered inside the node, then every rank's shard is
all-reduced with the ranks holding the same shard on the other nodes, over
the slow link. :class:`SparseReplicas` makes that all-reduce sparse, with
error feedback on each rank's shard: FSDP2 shards over the shard dimension
alone (``fully_shard(..., mesh=mesh["shard"])``), and each FSDP module's
all-reduce hook (``FSDPModule.set_all_reduce_hook``, FSDP2's public
extension point, called with the module's reduce-scattered flat shard, the
mean over the shard group) sends it through
:class:`~ddp_hooks.sparsify.SparseCompressor` over the replicate group:

.. math:: \hat s = \tfrac1R \textstyle\sum_{\text{replicas}} C(s + e),\qquad e \leftarrow s + e - C(s + e)

in place, so that FSDP makes the gradient's shard of :math:`\hat s`. The
residuals are per parameter shard (padded as FSDP2 pads it), ``1 / L`` of
the model per rank with ``L`` ranks in the shard group.

**Momentum in sends.** Given the user's ``torch.optim.SGD`` with momentum
``m`` (``optimizer=``), each rank's velocity steps where it sends,
``w = m w + p`` there, the replicas average what they sent, ``u_t``, and
the optimizer is handed ``u_t - m u_{t-1}``, so that its own buffer holds
``u_t``, as :func:`~ddp_hooks.sparsify_hook` does for DDP: a random
selector sends a coordinate about once every ``1 / density`` steps with all
it gathered, and the optimizer's momentum multiplying that burst by
``1 / (1 - m)`` diverges (``bench/README.md``, "FSDP2's replicas").

Checkpoints: :meth:`SparseReplicas.state_dict` holds this rank's residuals
under a key of its own rank, so that ``torch.distributed.checkpoint`` saves
each rank's beside the model's shards (each rank writes its own file, and
none holds another's) and loads them back in place::

    mesh = init_device_mesh("cuda", (nodes, gpus_per_node), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    replicas = SparseReplicas(model, mesh.get_group("replicate"), optimizer, method="random_block", density=0.01)
    ...
    dcp.save({"model": model.state_dict(), "replicas": replicas.state_dict()}, checkpoint_id=folder)
    # resume: build the same way, then
    state = {"model": model.state_dict(), "replicas": replicas.state_dict()}
    dcp.load(state, checkpoint_id=folder)
    model.load_state_dict(state["model"]); replicas.load_state_dict(state["replicas"])
"""

from __future__ import annotations

import math
from typing import Any, Dict, List

import torch
import torch.distributed as dist

from ..sparsify.compressor import SparseCompressor
from ..sparsify.memory import Layout
from ..sparsify.options import SparsifyOptions

__all__ = ["SparseReplicas"]


class SparseReplicas:
    """The replicate dimension's all-reduce of an FSDP2 model, sparse and error-fed; see the module docstring.

    Args:
        model: a module sharded by ``fully_shard(..., mesh=mesh["shard"])``
            (it and its sharded submodules).
        replicate_group: the group of the ranks holding the same shards, one
            per replica (``mesh.get_group("replicate")``).
        optimizer: the ``torch.optim.SGD`` that steps the model, whose
            momentum is then counted in sends (None: the average is handed
            over as it is).
        **options: the compressor's options, as ``SparsifyState`` takes them
            (``method``, ``density``, ``aggregation``, ``value_dtype``,
            ``seed``, ``block_size``, ``density_warmup_steps``,
            ``error_feedback``, ``warmup_steps``); layer scope.
    """

    def __init__(self, model: torch.nn.Module, replicate_group, optimizer=None, **options: Any) -> None:
        from torch.distributed.fsdp import FSDPModule

        for name in ("scope", "momentum", "weight_decay", "optimizer_momentum"):
            if name in options:
                raise ValueError(f"SparseReplicas does not take `{name}`: it sends each parameter's shard with a "
                                 "budget of its own (layer scope) and leaves momentum and weight decay to the "
                                 "optimizer, which steps the shards FSDP makes of the average")
        self.options = SparsifyOptions(**options)
        self.momentum = _momentum_of(optimizer)
        if self.momentum and not self.options.error_feedback:
            raise ValueError(f"`error_feedback`=False with `optimizer` of momentum {self.momentum}: SparseReplicas "
                             "counts the optimizer's momentum in sends, which needs error feedback (the velocity "
                             "steps where the rank sends what it kept)")
        self.compressor = SparseCompressor(self.options)
        self.last_update: Dict[int, torch.Tensor] = {}  # per module, u_{t-1} (with momentum)
        self.group = replicate_group
        self.keys = {id(p): key for key, p in enumerate(model.parameters())}
        sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
        if not sharded:
            raise ValueError(f"SparseReplicas needs a model sharded by FSDP2, got a {type(model).__name__} without "
                             "FSDP2 modules: call fully_shard(module, mesh=mesh['shard']) on its blocks and on the "
                             "model first")
        self.layouts: List[Layout] = []
        self.steps: List[int] = []
        for module in sharded:
            layout = self._layout(module, sharded)
            if not layout:  # every parameter belongs to a submodule's own FSDP group
                continue
            index = len(self.layouts)
            self.layouts.append(layout)
            self.steps.append(0)
            module.set_all_reduce_hook(lambda shard, index=index: self.all_reduce_(index, shard))

    def _layout(self, module, sharded) -> Layout:
        """``(key, offset, numel)`` of each parameter ``module`` manages, in its flat shard, padded as FSDP2 pads.

        FSDP2 lays a module's parameters end to end in the order of
        ``named_parameters``, each padded to ``ceil(dim0 / L)`` rows.
        """
        inner = {id(p) for child in sharded if child is not module and _inside(child, module)
                 for p in child.parameters()}
        layout, offset = [], 0
        for param in module.parameters():
            if id(param) in inner:
                continue
            size = param.shape[0] if param.dim() else 1
            rows = -(-size // param.device_mesh.size()) if hasattr(param, "device_mesh") else size
            numel = rows * math.prod(param.shape[1:])
            layout.append((self.keys[id(param)], offset, numel))
            offset += numel
        return tuple(layout)

    def all_reduce_(self, index: int, shard: torch.Tensor) -> None:
        """FSDP's all-reduce hook of module ``index``: ``shard`` becomes the replicas' error-fed sparse mean."""
        layout = self.layouts[index]
        if shard.numel() != layout[-1][1] + layout[-1][2]:
            raise RuntimeError(f"FSDP handed SparseReplicas a shard of {shard.numel()} entries where its parameters "
                               f"take {layout[-1][1] + layout[-1][2]}: a parameter without a gradient leaves the "
                               "shard; call module.set_reduce_scatter_unused_params(True) on such modules")
        step = self.steps[index]
        everything = step < self.options.warmup_steps
        # FSDP reads the shard once the hook returns, so the exchange is waited for here (on a GPU this orders
        # the hook's stream)
        self.compressor.exchange(shard, layout, self.group, step=step, key=index, everything=everything,
                                 density=1.0 if everything else self.options.density_at(step),
                                 momentum=None if everything or not self.momentum else self.momentum).wait()
        if self.momentum and not everything:  # hand over u_t - m u_{t-1}; remember u_t (a discarded step: as before)
            discard = ~torch.isfinite(shard).all()  # (a discarded exchange writes NaN, a kept one finite values)
            update, previous = shard.to(torch.float32, copy=True), self.last_update.get(index)
            if previous is not None:
                previous = previous.to(shard.device)  # (loaded on the CPU; a no-op once in place)
                shard.sub_((previous * self.momentum).to(shard.dtype))
            self.last_update[index] = torch.where(discard, 0.0 if previous is None else previous, update)
        self.steps[index] = step + 1

    # ----- checkpoints -----
    def state_dict(self) -> Dict[str, Any]:
        """``{"rank<r>": this rank's steps and residuals}``: under ``torch.distributed.checkpoint``, each rank's own."""
        residuals = self.compressor.residuals.state()
        for layout in self.layouts:  # residuals not formed yet are zeros of their size, so a load has a place
            for key, _, numel in layout:
                residuals.setdefault(key, torch.zeros(numel))
        velocities = self.compressor.velocities.state()
        last_updates = dict(self.last_update)
        for index, layout in enumerate(self.layouts):  # what is not formed yet: zeros of its size
            numel = layout[-1][1] + layout[-1][2]
            last_updates.setdefault(index, torch.zeros(numel))
            for key, _, n in layout:
                residuals.setdefault(key, torch.zeros(n))
                velocities.setdefault(key, torch.zeros(n))
        mine = {"steps": torch.tensor(self.steps, dtype=torch.int64),
                "residuals": {str(k): v for k, v in sorted(residuals.items())},
                "config": f"{self.options.describe(self.options.config_ints())}, momentum in sends={self.momentum}"}
        if self.momentum:
            mine["velocities"] = {str(k): v for k, v in sorted(velocities.items())}
            mine["last_updates"] = {str(i): u for i, u in sorted(last_updates.items())}
        return {f"rank{dist.get_rank()}": mine}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load this rank's entry of a :meth:`state_dict` saved with the same options and mesh."""
        key = f"rank{dist.get_rank()}"
        if key not in state_dict:
            raise ValueError(f"the SparseReplicas state holds {sorted(state_dict)} but not {key!r}: each rank "
                             "resumes its own residuals, so resume on the mesh that saved them")
        mine = state_dict[key]
        config = f"{self.options.describe(self.options.config_ints())}, momentum in sends={self.momentum}"
        if mine["config"] != config:
            raise ValueError(f"the SparseReplicas state was saved with {mine['config']} but this one has {config}; "
                             "build it with the saved options to resume")
        steps = [int(s) for s in mine["steps"]]
        if len(steps) != len(self.steps):
            raise ValueError(f"the SparseReplicas state holds {len(steps)} sharded modules but this model has "
                             f"{len(self.steps)}: it was saved from another model")
        self.steps = steps
        self.compressor.residuals.load({int(k): v for k, v in mine["residuals"].items()})
        self.compressor.velocities.load({int(k): v for k, v in mine.get("velocities", {}).items()})
        self.last_update = {int(i): u.clone() for i, u in mine.get("last_updates", {}).items() if int(steps[int(i)])}


def _momentum_of(optimizer) -> float:
    """The momentum ``optimizer`` (an SGD, or None) applies to every parameter; refuses several or another kind."""
    if optimizer is None:
        return 0.0
    if not isinstance(optimizer, torch.optim.SGD):
        raise TypeError(f"`optimizer` must be the torch.optim.SGD that steps the model (its momentum is counted in "
                        f"sends), or None, got {type(optimizer).__name__}")
    values = {float(group["momentum"]) for group in optimizer.param_groups}
    if len(values) != 1:
        raise ValueError(f"`optimizer` has momenta {sorted(values)} in its parameter groups; SparseReplicas counts one "
                         "momentum in sends for the whole model")
    for group in optimizer.param_groups:
        if group.get("nesterov") or group.get("dampening"):
            raise ValueError(f"`optimizer` has nesterov={group.get('nesterov')}, dampening={group.get('dampening')}; "
                             "SparseReplicas hands it u_t - m u_(t-1) so that its plain heavy-ball buffer holds u_t, "
                             "which those would change: use nesterov=False, dampening=0")
    return values.pop()


def _inside(child: torch.nn.Module, parent: torch.nn.Module) -> bool:
    return any(m is child for m in parent.modules())


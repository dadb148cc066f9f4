"""The selector seam: a fourth selector is one class and one registration, and runs through the hook.

``FirstK`` keeps the first ``k`` entries of each unit: trivially shared by all ranks, so it
serves AllReduce (values only) and AllGather (positions recomputed on every rank). It is
registered in the worker processes only, so this process's list of methods stays as shipped.
"""

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_hooks import SparsifyState, sparsify_hook
from ddp_hooks.sparsify.options import SparsifyOptions
from ddp_hooks.sparsify.selectors import Selector, register_selector, selector_names
from ddp_hooks.testing import run_distributed
from small_mlp import batch, small_mlp


class FirstK(Selector):
    name, code = "first_k", 1000

    def choose(self, request, ks):
        return torch.cat([torch.arange(u.offset, u.offset + k, device=request.where)
                          for u, k in zip(request.units, ks)])


def _train_with_first_k(rank, world_size, aggregation):
    register_selector(FirstK)
    model = DDP(small_mlp())
    state = SparsifyState(method="first_k", density=0.1, aggregation=aggregation, density_warmup_steps=0)
    model.register_comm_hook(state, sparsify_hook)
    params = list(model.module.parameters())
    sent_total = [torch.zeros_like(p) for p in params]
    grad_total = [torch.zeros_like(p) for p in params]
    for step in range(3):
        model.zero_grad()
        x = batch(rank, step)
        model(x).square().mean().backward()
        for p, sent in zip(params, sent_total):
            flat = p.grad.reshape(-1)
            k = -(-flat.numel() // 10)  # ceil(0.1 n): each layer is a unit
            assert not flat[k:].any(), "an entry past the first k of its layer was sent"
            sent.add_(p.grad)
        # the mean of every rank's true gradient, for the mass check
        reference = small_mlp()
        reference.load_state_dict(model.module.state_dict())
        reference(x).square().mean().backward()
        for ref, total in zip(reference.parameters(), grad_total):
            g = ref.grad.clone()
            dist.all_reduce(g)
            total.add_(g / world_size)
    # nothing lost: what arrived plus the mean residual is the mean gradient
    for p, sent, total in zip(params, sent_total, grad_total):
        residual = state.residual_for(p)
        dist.all_reduce(residual)
        assert torch.allclose(sent + residual / world_size, total, atol=1e-6)
    assert state.stats()["elements_sent"] == 3 * sum(-(-p.numel() // 10) for p in params)
    dist.barrier()
    return state.state_dict()["config"]["method"]


@pytest.mark.parametrize("aggregation", ["allreduce", "allgather"])
def test_a_fourth_selector_runs_through_the_hook_at_two_ranks(aggregation):
    assert run_distributed(_train_with_first_k, 2, aggregation) == [1000, 1000]  # its code in checkpoints
    assert "first_k" not in selector_names()  # registered in the workers only


def test_the_registry_refuses_a_taken_name_or_code_and_an_unservable_selector():
    class Clash(Selector):
        name, code = "topk", 1001

    with pytest.raises(ValueError, match="name 'topk' is taken by TopK"):
        register_selector(Clash)
    Clash.name, Clash.code = "clash", 2
    with pytest.raises(ValueError, match="code 2 is taken by RandomBlock.*never reused"):
        register_selector(Clash)

    class Blind(Selector):
        name, code, reads_values = "blind", 1002, True

    with pytest.raises(ValueError, match="reads values under AllGather but does not send its positions"):
        register_selector(Blind)
    with pytest.raises(TypeError, match="must be a subclass"):
        register_selector(object)
    assert {"clash", "blind"}.isdisjoint(selector_names())


def test_checkpoint_codes_are_explicit():
    # What states saved today mean; these numbers may never change (README, "Adding a selector": checkpoints
    # store each selector's `code`).
    options = SparsifyOptions(method="topk", scope="global", aggregation="allgather", optimizer_momentum="steps")
    ints = options.config_ints()
    assert (ints["method"], ints["scope"], ints["aggregation"], ints["optimizer_momentum"]) == (0, 2, 1, 2)
    codes = {name: SparsifyOptions(method=name, aggregation="allgather").config_ints()["method"]
             for name in ("topk", "randomk", "random_block")}
    codes["shared_topk"] = SparsifyOptions(method="shared_topk").config_ints()["method"]
    assert codes == {"topk": 0, "randomk": 1, "random_block": 2, "shared_topk": 3}


def _string_constants_outside_docstrings(module):
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(module))
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and node.body
                  and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return {node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings}


def test_the_exchange_never_names_a_selector():
    from ddp_hooks.sparsify import compressor, hook, memory

    for module in (compressor, hook, memory):
        named = _string_constants_outside_docstrings(module) & {"topk", "randomk", "random_block", "shared_topk"}
        assert not named, (module.__name__, named)

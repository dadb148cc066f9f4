"""Our hooks under ``torch.compile``: every selector and Local AdaAlter give eager mode's weights, within float
tolerance, where the model is compiled inside DDP or DDP is compiled; DDP built in the mode of compiled autograd
(``optimize_ddp="python_reducer"``), which calls hooks with ``(grad, param)`` instead of buckets, is refused
with what to do."""

import shutil

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_hooks import SparsifyState, build_local_adaalter, sparsify_hook
from ddp_hooks.testing import run_distributed
from small_mlp import batch, flat, small_mlp

STEPS = 4
SETUPS = ["topk", "randomk", "random_block", "shared_topk", "local_adaalter"]


def _train(rank, setup, path, compiled_graphs):
    """``STEPS`` steps of plain SGD (Local AdaAlter: its own optimizer) with the hook; ``path`` is "eager",
    "compile_module" (``DDP(torch.compile(model))``) or "compile_ddp" (``torch.compile(DDP(model))``)."""
    def counting_inductor(graph, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        compiled_graphs.append(len(graph.graph.nodes))
        return compile_fx(graph, example_inputs)

    torch._dynamo.reset()
    net = small_mlp()
    model = DDP(torch.compile(net, backend=counting_inductor) if path == "compile_module" else net)
    if setup == "local_adaalter":
        state, optimizer = build_local_adaalter(model, lr=0.1, period=2, warmup_steps=1)
    else:
        state = SparsifyState(method=setup, density=0.1, density_warmup_steps=0,
                              aggregation="allreduce" if setup != "topk" else "allgather")
        model.register_comm_hook(state, sparsify_hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run = torch.compile(model, backend=counting_inductor) if path == "compile_ddp" else model
    for step in range(STEPS):
        x = batch(rank, step)
        optimizer.zero_grad()
        F.mse_loss(run(x), x[:, :5]).backward()
        optimizer.step()
    ran = ((state.allreduce_calls, optimizer.schedule.last_sync) if setup == "local_adaalter"
           else state.stats()["compressed_steps"])
    return flat(net.parameters()), ran


def _against_eager(rank, world, path):
    results = {}
    for setup in SETUPS:
        graphs = []
        eager, eager_ran = _train(rank, setup, "eager", [])
        compiled, compiled_ran = _train(rank, setup, path, graphs)
        results[setup] = ((eager - compiled).abs().max().item(), eager_ran, compiled_ran, len(graphs))
    return results


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")),
                    reason="inductor needs a C++ compiler on the CPU: apt-get install g++")
@pytest.mark.parametrize("path", ["compile_module", "compile_ddp"])
def test_every_hook_gives_eager_weights_when_compiled(path):
    everyone = run_distributed(_against_eager, 2, path, timeout=300)
    print(f"graphs compiled on rank 0 with {path}:", {setup: graphs for setup, (*_, graphs) in everyone[0].items()})
    for results in everyone:
        for setup, (difference, eager_ran, compiled_ran, graphs) in results.items():
            assert difference < 1e-6, (setup, difference)
            expected = (1, STEPS - 1) if setup == "local_adaalter" else STEPS  # LAA: 1 warm-up step, then H = 2
            assert eager_ran == compiled_ran == expected, (setup, eager_ran, compiled_ran)
            if path == "compile_module":
                assert graphs >= 1, setup  # the model really was compiled


def _under_the_python_reducer(rank, world):
    """DDP built in the mode compiled autograd uses calls hooks per parameter, compiled model or not."""
    torch._dynamo.reset()
    torch._dynamo.config.optimize_ddp = "python_reducer"
    try:
        model = DDP(small_mlp())  # the mode is fixed here, at construction
        model.register_comm_hook(SparsifyState(method="random_block", density=0.1), sparsify_hook)
        x = batch(rank, 0)
        model(x).sum().backward()
    except Exception as error:
        return str(error)
    finally:
        torch._dynamo.config.optimize_ddp = True
    return None


def test_the_python_reducer_is_refused_with_what_to_do():
    for message in run_distributed(_under_the_python_reducer, 2, timeout=300):
        assert message is not None and "received (grad, param) instead of a torch.distributed.GradBucket" in message
        assert "optimize_ddp was 'python_reducer'" in message and "optimize_ddp at its default (True)" in message

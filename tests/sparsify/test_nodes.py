"""The hierarchical exchange (SparsifyState(nodes=...)): dense inside a node, sparse between nodes, on gloo."""

import os

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_hooks import SparsifyState, sparsify_hook
from ddp_hooks.sparsify.nodes import Sharding, check_node_spec, node_ranks
from ddp_hooks.sparsify.selectors import budget
from ddp_hooks.testing import assert_replicas_equal, run_distributed
from small_mlp import COMBOS, batch, flat, small_mlp


# ----- one process -----
def test_node_ranks_from_an_int_a_list_and_local_world_size(monkeypatch):
    assert node_ranks(2, 6) == [[0, 1], [2, 3], [4, 5]]
    assert node_ranks(((0, 2), (1, 3)), 4) == [[0, 2], [1, 3]]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert node_ranks("local", 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    with pytest.raises(RuntimeError, match="LOCAL_WORLD_SIZE"):
        node_ranks("local", 8)
    with pytest.raises(ValueError, match="does not divide the world size 6"):
        node_ranks(4, 6)
    with pytest.raises(ValueError, match="exactly once"):
        node_ranks(((0, 1), (2, 4)), 4)


@pytest.mark.parametrize("bad, error, words", [
    (0, ValueError, ">= 1"), ("nodes", ValueError, "'local'"), (True, ValueError, "'local'"),
    (((0, 1), (2,)), ValueError, "one size"), (((0, 1), (1, 2)), ValueError, "twice"), (2.5, TypeError, "float"),
    (((0, 1.5),), TypeError, "must hold ints"),
])
def test_bad_nodes_are_refused_before_any_process_group(bad, error, words):
    with pytest.raises(error, match=words):
        check_node_spec(bad)
    with pytest.raises(error, match=words):
        SparsifyState(nodes=bad)


def test_a_sharding_cuts_each_parameter_into_pieces_and_back():
    layout = ((0, 0, 5), (1, 5, 0), (2, 5, 7), (3, 12, 1))  # an empty parameter, and one smaller than L
    bucket = torch.arange(1.0, 14.0)
    sharding = Sharding(layout, 13, size=3, device=torch.device("cpu"))  # every local rank's: shard j at 6 j
    assert sharding.layout == ((0, 0, 2), (1, 2, 0), (2, 2, 3), (3, 5, 1)) and sharding.numel == 6
    padded = torch.zeros(18).index_copy_(0, sharding.destination, bucket)
    # piece j of parameter 2 (entries 6..12) is entries [3j, 3j + 3) of it, the last piece padded with zeros
    assert padded[6 * 1 + 2:6 * 1 + 5].tolist() == [9.0, 10.0, 11.0]
    assert padded[6 * 2 + 2:6 * 2 + 5].tolist() == [12.0, 0.0, 0.0]
    assert torch.equal(padded.index_select(0, sharding.destination), bucket)
    assert int((padded != 0).sum()) == 13


# ----- on gloo, 4 ranks in 2 nodes -----
def _run(rank, world, nodes, method, scope, aggregation, steps=4, density=0.1, seed=7):
    state = SparsifyState(method=method, density=density, scope=scope, aggregation=aggregation, seed=seed,
                          density_warmup_steps=0, nodes=nodes)
    model = DDP(small_mlp(), bucket_cap_mb=0.002)  # several buckets after the rebuild
    model.register_comm_hook(state, sparsify_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for step in range(steps):
        optimizer.zero_grad()
        model(batch(rank, step)).pow(2).sum().backward()
        grads.append(flat(p.grad for p in model.parameters()))
        optimizer.step()
    return state, model, grads


def _mass_and_replicas(rank, world, nodes, method, scope, aggregation):
    # Σ_t W ĝ_t + L Σ_nodes e_T = Σ_r Σ_t g_t^(r): with plain SGD, replayed by each rank without the exchange
    state, model, grads = _run(rank, world, nodes, method, scope, aggregation)
    assert_replicas_equal(model)
    rows = [torch.empty_like(grads[0]) for _ in range(world)]
    for g in grads:  # every rank received the same average
        dist.all_gather(rows, g)
        assert all(torch.equal(r, rows[0]) for r in rows)
    ranks_per_node = len(node_ranks(nodes, world)[0])
    # this rank's piece of every parameter, laid back out: the residual mass of its node's shard
    pieces = [state.residual_for(p) for p in model.parameters()]
    mine = torch.cat([_spread_piece(piece, p.numel(), ranks_per_node, rank_in_node(nodes, world, rank))
                      for piece, p in zip(pieces, model.parameters())])
    total_residual = mine.clone()
    dist.all_reduce(total_residual)
    sent = sum(grads) * world + ranks_per_node * total_residual
    # replay: the same weights, each rank's own gradients, summed over ranks
    replay = small_mlp()
    own = torch.zeros_like(grads[0])
    for step, g in enumerate(grads):
        replay.zero_grad()
        replay(batch(rank, step)).pow(2).sum().backward()
        own += flat(p.grad for p in replay.parameters())
        with torch.no_grad():
            offset = 0
            for p in replay.parameters():
                p.add_(g[offset:offset + p.numel()].view_as(p), alpha=-0.1)
                offset += p.numel()
    dist.all_reduce(own)
    torch.testing.assert_close(sent, own, rtol=1e-4, atol=1e-4)
    residual_entries = sum(piece.numel() for piece in pieces)
    n = sum(p.numel() for p in model.parameters())
    assert residual_entries <= n // ranks_per_node + len(pieces), (residual_entries, n)
    return residual_entries


def rank_in_node(nodes, world, rank):
    return next(node.index(rank) for node in node_ranks(nodes, world) if rank in node)


def _spread_piece(piece, numel, size, local_rank):
    """A rank's piece of a parameter of ``numel`` entries, laid out in the parameter (zeros elsewhere)."""
    c = -(-numel // size)
    out = torch.zeros(size * c)
    out[local_rank * c:(local_rank + 1) * c] = piece.reshape(-1)
    return out[:numel]


def _every_combo(rank, world, nodes):
    return [_mass_and_replicas(rank, world, nodes, *combo) for combo in COMBOS]


@pytest.mark.parametrize("nodes", [2, ((0, 2), (1, 3))])
def test_every_combo_conserves_mass_keeps_replicas_equal_and_a_shard_of_the_residuals(nodes):
    entries = run_distributed(_every_combo, 4, nodes, timeout=300)
    n = sum(p.numel() for p in small_mlp().parameters())
    assert all(e <= n // 2 + 4 for per_rank in entries for e in per_rank)


def _one_rank_per_node_is_flat(rank, world, method, scope, aggregation):
    _, _, hierarchical = _run(rank, world, 1, method, scope, aggregation)
    _, _, flat_run = _run(rank, world, None, method, scope, aggregation)
    return all(torch.equal(a, b) for a, b in zip(hierarchical, flat_run))


@pytest.mark.parametrize("combo", [("random_block", "layer", "allreduce"), ("topk", "bucket", "allgather"),
                                   ("shared_topk", "layer", "allreduce"), ("randomk", "global", "allgather")])
def test_one_rank_per_node_is_the_flat_exchange_bitwise(combo):
    assert all(run_distributed(_one_rank_per_node_is_flat, 2, *combo))


# ----- resume, refusals, non-finite steps -----
def _build(nodes, method="random_block", scope="layer", aggregation="allreduce", **options):
    model = DDP(small_mlp(), bucket_cap_mb=0.002)
    state = SparsifyState(method=method, density=0.1, scope=scope, aggregation=aggregation, seed=3, nodes=nodes,
                          density_warmup_steps=0, **options)
    model.register_comm_hook(state, sparsify_hook)
    momentum = 0.0 if "momentum" in options else 0.9  # the optimizer's momentum, counted in sends by the hook
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum), state


def _train(rank, model, optimizer, start, stop):
    for step in range(start, stop):
        optimizer.zero_grad()
        model(batch(rank, step)).pow(2).mean().backward()
        optimizer.step()


def _resume(rank, world, tmp, nodes, combo, options, n=3):
    model, optimizer, state = _build(nodes, *combo, **options)
    _train(rank, model, optimizer, 0, 2 * n)
    straight = flat(model.parameters())
    model, optimizer, state = _build(nodes, *combo, **options)
    _train(rank, model, optimizer, 0, n)
    path = f"{tmp}/rank{rank}.pt"
    torch.save({"model": model.state_dict(), "opt": optimizer.state_dict(), "hook": state.state_dict()}, path)
    model, optimizer, state = _build(nodes, *combo, **options)
    saved = torch.load(path, weights_only=True)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["opt"])
    state.load_state_dict(saved["hook"])
    _train(rank, model, optimizer, n, 2 * n)
    assert_replicas_equal(model)
    return torch.equal(straight, flat(model.parameters()))


@pytest.mark.parametrize("combo, options", [
    (("random_block", "layer", "allreduce"), {}),  # the optimizer's momentum counted in sends
    (("topk", "global", "allgather"), {}),
    (("shared_topk", "layer", "allreduce"), {"value_dtype": "float16"}),  # (bucket scope: README, known limits)
    (("randomk", "layer", "allgather"), {"momentum": 0.9, "weight_decay": 5e-4}),  # the hook's own velocity
])
def test_resume_is_bitwise(tmp_path, combo, options):
    assert run_distributed(_resume, 4, str(tmp_path), 2, combo, options, timeout=300) == [True] * 4


def _other_nodes(rank, world, saved_nodes, resumed_nodes):
    model, optimizer, state = _build(saved_nodes)
    _train(rank, model, optimizer, 0, 2)
    saved = state.state_dict()
    model, optimizer, state = _build(resumed_nodes)
    state.load_state_dict(saved)
    _train(rank, model, optimizer, 2, 3)


@pytest.mark.parametrize("saved, resumed, words", [
    (2, 4, "saved with nodes of 2 ranks, this rank .* in its node but this run has nodes of 4 ranks"),
    (None, 2, "saved with a flat exchange"),
    # the same sizes, other places: ranks 1 and 2 swap pieces between nodes=2 and ((0, 2), (1, 3)) (either raises)
    (2, ((0, 2), (1, 3)), r"nodes of 2 ranks, this rank (\d) in its node but this run has nodes of 2 ranks, "
                          r"this rank (?!\1)\d in its node"),
])
def test_state_saved_with_other_nodes_is_refused(saved, resumed, words):
    with pytest.raises(ValueError, match=words):
        run_distributed(_other_nodes, 4, saved, resumed, timeout=120)


def _different_nodes(rank, world, first, others):
    model, optimizer, _ = _build(others if rank else first)
    _train(rank, model, optimizer, 0, 1)


@pytest.mark.parametrize("first, others, words", [
    (4, 2, "rank 0 has .*nodes=4 ranks per node.* but rank 1 has .*nodes=2 ranks"),
    (2, ((0, 2), (1, 3)), r"rank 0 has .*nodes=2 ranks per node \(their lists' code \d+\) but rank 1 has .*nodes=2 ranks "
                          r"per node \(their lists' code \d+\)"),  # the same size, other members: no group is made
])
def test_ranks_with_different_nodes_all_raise_the_same_error(first, others, words):
    with pytest.raises(ValueError, match=words):
        run_distributed(_different_nodes, 4, first, others, timeout=120)


def _nonfinite(rank, world):
    model, optimizer, state = _build(2)
    _train(rank, model, optimizer, 0, 2)
    before = [state.residual_for(p) for p in model.parameters()]
    optimizer.zero_grad()
    last_bias = model.module[3].bias
    if rank == 1:  # one entry on one rank: after the reduce-scatter it is in rank 0's shard only
        last_bias.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))
    model(batch(rank, 2)).pow(2).mean().backward()
    assert not torch.isfinite(flat(p.grad for p in model.parameters())).all()  # GradScaler skips it on every rank
    after = [state.residual_for(p) for p in model.parameters()]
    return all(torch.equal(a, b) for a, b in zip(before, after)), int(state.stats()["nonfinite_steps"])


def test_a_nonfinite_gradient_on_one_rank_is_discarded_by_every_rank():
    assert run_distributed(_nonfinite, 4, timeout=120) == [(True, 1)] * 4


def _trains(rank, world, nodes):
    model, optimizer, state = _build(nodes)
    losses = []
    for step in range(30):
        optimizer.zero_grad()
        x = batch(0, step % 4)  # every rank the same four batches: the loss must fall
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses[0], losses[-1], state.stats()["compression_ratio"]


def test_the_loss_falls_and_the_slow_link_carries_density_over_ranks_per_node():
    for first, last, ratio in run_distributed(_trains, 4, 2, timeout=120):
        assert last < 0.5 * first
        # per rank, against a flat dense allreduce: density 0.1 of 1/2 of the entries (plus budgets rounded up)
        assert 14 < ratio <= 20, ratio


def _sparse_and_dense_gathers(rank, world, combo, options):
    from ddp_hooks.sparsify import nodes

    def weights():  # momentum SGD (by default counted in sends: the written entries include u_(t-1)'s)
        model, optimizer, _ = _build(2, *combo, **options)
        _train(rank, model, optimizer, 0, 5)
        return flat(model.parameters())

    whole, sparse_gathers = nodes.NodeShard.start_gather, []

    def counting(self, group, written=None):
        whole(self, group, written)
        sparse_gathers.append(self.entries is not None)

    nodes.NodeShard.start_gather = counting
    try:
        sparse = weights()
        nodes.NodeShard.start_gather = lambda self, group, written=None: whole(self, group, None)
        dense = weights()
    finally:
        nodes.NodeShard.start_gather = whole
    return torch.equal(sparse, dense), sum(sparse_gathers)


@pytest.mark.parametrize("combo, options", [
    (("random_block", "layer", "allreduce"), {}), (("topk", "layer", "allgather"), {}),
    # bucket scope with the momentum counted in sends gathers whole shards; in steps, the written entries
    (("topk", "bucket", "allgather"), {"optimizer_momentum": "steps"}),
])
def test_gathering_the_written_entries_equals_gathering_the_whole_shards(combo, options):
    for equal, sparse_gathers in run_distributed(_sparse_and_dense_gathers, 4, combo, options, timeout=120):
        assert equal and sparse_gathers > 0

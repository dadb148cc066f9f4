"""Shared top-k: the leader's top-k positions, rotating over ranks and units, used by every rank."""

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_hooks import SparsifyState, sparsify_hook
from ddp_hooks.sparsify.selectors import budget
from ddp_hooks.sparsify.selectors.shared_topk import SPREAD_FROM, leaders
from ddp_hooks.testing import run_distributed
from small_mlp import batch, small_mlp


def test_the_leader_rotates_with_the_step_and_across_units():
    big, small = SPREAD_FROM, SPREAD_FROM - 1
    assert leaders([0, 1, 2, 3], [big] * 4, step=0, world_size=4) == [0, 1, 2, 3]
    assert leaders([0, 1, 2, 3], [big] * 4, step=1, world_size=4) == [1, 2, 3, 0]
    # over W steps every rank leads every unit once, large or small
    for numel in (big, small, 1):
        assert sorted(leaders([5], [numel], step=s, world_size=3)[0] for s in range(3)) == [0, 1, 2]


def test_small_units_share_one_leader_per_step():
    """Units under SPREAD_FROM entries lead as key 0: a model of small layers waits for one leader a step."""
    big, small = SPREAD_FROM, SPREAD_FROM - 1
    assert leaders([1, 2, 3, 6], [small, 10, big, big], step=1, world_size=4) == [1, 1, 0, 3]
    assert leaders([1, 2, 3], [small, 10, 1], step=2, world_size=4) == [2, 2, 2]


def test_it_serves_allreduce_only():
    with pytest.raises(ValueError, match="`aggregation`='allgather' cannot be used with `method`='shared_topk'"):
        SparsifyState(method="shared_topk", aggregation="allgather")


def _leaders_choose(rank, world, scope):
    model = DDP(small_mlp(), bucket_cap_mb=0.002)  # several buckets: positions awaited a bucket later
    state = SparsifyState(method="shared_topk", density=0.1, scope=scope, density_warmup_steps=0)
    model.register_comm_hook(state, sparsify_hook)
    params = list(model.module.parameters())
    reference = small_mlp()
    out = []
    for step in range(3):
        before = {id(p): state.residual_for(p) for p in params}
        reference.load_state_dict(model.module.state_dict())
        reference.zero_grad()
        reference(batch(rank, step)).square().mean().backward()
        # this rank's compensated gradient p = g + e, per parameter
        compensated = [r.grad + before[id(p)] for r, p in zip(reference.parameters(), params)]
        model.zero_grad()
        model(batch(rank, step)).square().mean().backward()
        sent = [p.grad != 0 for p in params]
        if scope == "layer":  # each layer is a unit, keyed by its parameter's key 
            for p, mask, c in zip(params, sent, compensated):
                leader = leaders([state.layouts.key_of(p)], [p.numel()], step, world)[0]
                k = budget(p.numel(), 0.1)
                mine = torch.zeros(p.numel(), dtype=torch.bool)
                mine[torch.topk(c.reshape(-1).abs(), k).indices] = True
                gathered = [torch.empty_like(mine) for _ in range(world)]
                dist.all_gather(gathered, mine)
                assert torch.equal(mask.reshape(-1), gathered[leader]), (step, state.layouts.key_of(p))
                out.append(leader)
        else:  # one unit: the whole bucket , led by rank step % world
            flat_mask = torch.cat([m.reshape(-1) for m in sent])
            assert int(flat_mask.sum()) <= budget(flat_mask.numel(), 0.1)
            out.append(step % world)
    stats = state.stats()
    dist.barrier()
    return out, stats["bytes_sent"], stats["elements_sent"]


@pytest.mark.parametrize("scope", ["layer", "bucket"])
def test_every_rank_sends_at_its_leaders_top_k_positions(scope):
    """Checked layer by layer over several buckets, so also for positions awaited a bucket after their own."""
    (leads, sent_bytes, elements), (_, other_bytes, _) = run_distributed(_leaders_choose, 2, scope)
    if scope == "layer":
        assert sorted(set(leads)) == [0, 1]  # both ranks lead some layers
    # the stats count the positions each rank sends to agree, beside its values
    assert sent_bytes > 4 * elements and other_bytes > 4 * elements


def _positions_travel_exactly(rank, world):
    from ddp_hooks.sparsify.selectors import SelectionRequest, Unit, selector_for
    # sizes around the int16 code's edge (65,536 entries) and past it (int32), and a tiny unit
    cases = [(Unit(0, 0, 65536), Unit(1, 65536, 7), Unit(2, 65543, 40000)),
             (Unit(4, 0, 65537), Unit(5, 65537, 3))]
    out = []
    for step in range(2):
        for units in cases:
            end = units[-1].offset + units[-1].numel
            generator = torch.Generator().manual_seed(100 * rank + step)
            magnitude = torch.rand(end, generator=generator)
            magnitude[units[0].offset + units[0].numel - 1] = 2.0 + rank  # the last entry of the big unit
            request = SelectionRequest(units=units, density=0.01, seed=0, step=step, magnitude=magnitude,
                                       group=dist.group.WORLD, world_size=world)
            selector = selector_for("shared_topk")
            chosen = selector.select(request)
            # what each rank would choose for itself, gathered: unit i's positions must be its leader's
            own = torch.cat([torch.topk(magnitude[u.offset:u.offset + u.numel], budget(u.numel, 0.01)).indices
                             .sort().values + u.offset for u in units])
            everyone = [torch.empty_like(own) for _ in range(world)]
            dist.all_gather(everyone, own)
            lead = leaders([u.key for u in units], [u.numel for u in units], step, world)
            start = 0
            for u, leader in zip(units, lead):
                k = budget(u.numel, 0.01)
                assert torch.equal(chosen[start:start + k].sort().values, everyone[leader][start:start + k])
                start += k
            out.append(selector.agreement_bytes(request))
    return out


def test_positions_travel_exactly_in_their_smallest_code():
    counts = run_distributed(_positions_travel_exactly, 3)
    # each rank counts the positions it broadcasts as a leader. Step 0, first case: rank 0 leads unit 0
    # (656 positions) and, as they are under SPREAD_FROM entries, units 1 (1) and 2 (400), as int16; second
    # case: rank 1 leads unit 4 (656), rank 0 the small unit 5 (1), as int32 (65,537 entries do not fit int16)
    assert [c[:2] for c in counts] == [[(656 + 1 + 400) * 2, 1 * 4], [0, 656 * 4], [0, 0]]


def _when_positions_are_awaited(rank, world):
    from ddp_hooks.sparsify.selectors import Choice
    from ddp_hooks.sparsify.selectors.shared_topk import SharedTopK
    events = []
    begin = SharedTopK.begin

    def logged_begin(self, request, ks):
        choice, unit = begin(self, request, ks), request.units[0].key
        assert choice.waits  # the broadcasts are in flight

        def logged_wait():
            events.append(("wait", unit))
            return choice.wait()

        return Choice(logged_wait)

    SharedTopK.begin = logged_begin
    try:
        model = DDP(small_mlp(), bucket_cap_mb=0.002)
        state = SparsifyState(method="shared_topk", density=0.1, density_warmup_steps=0)

        def hook(state, bucket):
            events.append(("hook", state.layouts.key_of(bucket.parameters()[0]), bucket.is_last()))
            return sparsify_hook(state, bucket)

        model.register_comm_hook(state, hook)
        for step in range(3):  # the first step runs on DDP's initial buckets, the others on the rebuilt ones
            events.clear()
            model.zero_grad()
            model(batch(rank, step)).square().mean().backward()
    finally:
        SharedTopK.begin = begin
    return events


def test_a_buckets_positions_are_awaited_at_the_next_bucket():
    """The hook leaves the leaders' broadcasts in flight while the backward pass goes on: bucket b's positions
    are awaited in bucket b + 1's hook call (after b + 1's own broadcasts started), the last bucket's in its own."""
    for events in run_distributed(_when_positions_are_awaited, 2):
        hooks = [e for e in events if e[0] == "hook"]
        assert len(hooks) >= 2, events  # several buckets
        expected = []
        for i, (_, key, last) in enumerate(hooks):
            expected.append(hooks[i])
            if i > 0:
                expected.append(("wait", hooks[i - 1][1]))
            if last:
                expected.append(("wait", key))
        assert events == expected

"""Single-process checks: option validation, selectors, residual store, seeds."""

import pytest
import torch

from ddp_hooks import SparsifyState
from ddp_hooks._internal.codec import float_to_bits
from ddp_hooks.sparsify.memory import ResidualStore
from ddp_hooks.sparsify.selectors.draws import SHARED, derive_seed
from ddp_hooks.sparsify.selectors import Unit, budget, select
from paths import FIXTURES


@pytest.mark.parametrize("kwargs,exc,pattern", [
    ({"method": "top_k"}, ValueError, r"`method` must be one of 'topk', 'randomk', 'random_block', 'shared_topk', got 'top_k'"),
    ({"density": 0}, ValueError, r"`density` must be a float in \(0, 1\], got 0.0; it is the fraction"),
    ({"density": 1.5}, ValueError, r"`density` must be a float in \(0, 1\], got 1.5"),
    ({"density": float("nan")}, ValueError, r"`density` must be a float in \(0, 1\], got nan"),
    ({"density": "0.1"}, TypeError, r"`density` must be a float, got '0.1' of type str"),
    ({"density": True}, TypeError, r"`density` must be a float, got True"),
    ({"scope": "model"}, ValueError, r"`scope` must be one of 'layer', 'bucket', 'global', got 'model'"),
    ({"aggregation": "sum"}, ValueError, r"`aggregation` must be one of 'allreduce', 'allgather', got 'sum'"),
    ({"error_feedback": 1}, TypeError, r"`error_feedback` must be a bool, got 1 of type int"),
    ({"warmup_steps": -1}, ValueError, r"`warmup_steps` must be an int >= 0, got -1"),
    ({"warmup_steps": 2.0}, TypeError, r"`warmup_steps` must be an int, got 2.0"),
    ({"seed": -3}, ValueError, r"`seed` must be an int in \[0, 9223372036854775807\], got -3"),
    ({"process_group": "world"}, TypeError, r"`process_group` must be None .* got 'world' of type str"),
    ({"method": "topk", "aggregation": "allreduce"}, ValueError, r"cannot be used with `method`='topk'"),
    ({"grad_scaler": 2.0 ** 16}, TypeError, r"`grad_scaler` must be None or a torch.amp.GradScaler, got float"),
])
def test_bad_options_are_refused_before_any_process_group(kwargs, exc, pattern):
    assert not torch.distributed.is_initialized()
    with pytest.raises(exc, match=pattern):
        SparsifyState(**kwargs)


def test_hook_refuses_a_wrong_state_or_a_tensor_instead_of_a_bucket():
    from ddp_hooks import LocalSGDState, local_sgd_hook, sparsify_hook

    for hook, state in ((sparsify_hook, SparsifyState()), (local_sgd_hook, LocalSGDState())):
        name = hook.__name__
        with pytest.raises(TypeError, match=rf"{name} was registered with a state of type NoneType; it needs a "
                                            rf"{type(state).__name__}: ddp_model.register_comm_hook"):
            hook(None, torch.zeros(3))
        # FSDP calls its comm hooks with the gradient tensor itself
        with pytest.raises(TypeError, match=rf"{name} received a Tensor instead of a torch.distributed.GradBucket: "
                                            "it is a DistributedDataParallel comm hook"):
            hook(state, torch.zeros(3))
    assert not torch.distributed.is_initialized()


def test_density_one_warns():
    with pytest.warns(UserWarning, match="density=1 sends every entry"):
        SparsifyState(density=1.0)


def test_budget_rounds_up_without_float_noise():
    assert budget(100, 0.07) == 7
    assert budget(1000, 0.01) == 10
    assert budget(3, 0.01) == 1
    assert budget(5, 1.0) == 5


@pytest.mark.parametrize("density", [0.03, 0.3])  # 0.3: the paths for budgets that are a large fraction
@pytest.mark.parametrize("method", ["topk", "randomk", "random_block"])
def test_selectors_keep_exactly_k_distinct_positions_inside_each_unit(method, density):
    p = torch.randn(100_000 + 37)
    units = [Unit(0, 0, 37), Unit(1, 37, 100_000)]
    idx = select(method, p, units, density, seed=1, step=4)
    assert idx.numel() == budget(37, density) + budget(100_000, density)
    assert idx.unique().numel() == idx.numel()
    first = idx[: budget(37, density)]
    assert torch.all(first < 37) and torch.all(idx[budget(37, density):] >= 37)
    if method == "topk":
        assert torch.equal(idx[budget(37, density):].sort().values,
                           torch.topk(p[37:].abs(), budget(100_000, density)).indices.sort().values + 37)


def test_topk_keeps_the_largest_magnitudes():
    p = torch.tensor([0.1, -5.0, 0.3, 4.0, -0.2, 0.0])
    assert sorted(select("topk", p, [Unit(0, 0, 6)], 0.34, 0, 0).tolist()) == [1, 2, 3]  # k = ceil(2.04) = 3


def _runs(positions, n):
    """Contiguous runs in a unit's positions, read as a ring (a run may cross the end of the unit)."""
    ordered = positions.sort().values
    breaks = int((ordered.diff() != 1).sum()) + 1
    if ordered[0] == 0 and ordered[-1] == n - 1 and breaks > 1:
        breaks -= 1  # the run that crosses the end
    return breaks


@pytest.mark.parametrize("n,k,b", [(50, 10, 4), (37, 5, 16), (1000, 10, 16), (4096, 41, 16), (100, 99, 8),
                                   (10, 1, 16), (200, 30, 1)])
def test_random_block_sends_k_entries_in_a_set_of_blocks(n, k, b):
    for step in range(100):
        idx = select("random_block", torch.zeros(n), [Unit(0, 0, n)], k / n, seed=2, step=step, block_size=b)
        assert idx.numel() == k and idx.unique().numel() == k and 0 <= idx.min() and idx.max() < n
        # ceil(k / b) blocks, the last one trimmed, plus one where a block crosses the end of the unit
        assert _runs(idx, n) <= -(-k // b) + 1 + (b > 1)


def test_a_block_as_large_as_the_budget_is_one_contiguous_block():
    n, k = 50, 10
    for step in range(50):
        idx = select("random_block", torch.zeros(n), [Unit(0, 0, n)], k / n, seed=0, step=step, block_size=1 << 20)
        start = idx[0].item()
        assert idx.tolist() == [(start + j) % n for j in range(k)]


@pytest.mark.parametrize("rank", [SHARED, 3])
def test_blocks_of_many_units_equal_the_blocks_of_each_unit_alone(rank):
    # Gaps between units, units sent whole, one-entry units and short last blocks included.
    units = [Unit(7, 0, 1), Unit(2, 1, 50), Unit(9, 51, 1000), Unit(4, 1051, 1), Unit(5, 1060, 20), Unit(6, 1090, 3)]
    for step in range(40):
        together = select("random_block", torch.zeros(1093), units, 0.15, seed=11, step=step, rank=rank, block_size=8)
        alone = [select("random_block", torch.zeros(1093), [u], 0.15, seed=11, step=step, rank=rank, block_size=8)
                 for u in units]
        assert torch.equal(together, torch.cat(alone)), step
        assert together[0].item() == 0 and alone[3].item() == 1051  # one-entry units are sent whole


def test_random_block_choice_is_a_function_of_seed_step_unit_rank_and_block_size():
    args = dict(values=torch.zeros(1000), units=[Unit(3, 0, 1000)], density=0.05)
    a = select("random_block", seed=9, step=2, **args)
    assert torch.equal(a, select("random_block", seed=9, step=2, **args))
    for other in (dict(step=3), dict(rank=1), dict(block_size=16)):
        assert not torch.equal(a, select("random_block", **{"seed": 9, "step": 2, **other}, **args))


@pytest.mark.parametrize("n,k,b", [(37, 5, 16), (40, 6, 4), (100, 30, 16)])
def test_every_coordinate_is_equally_likely_in_random_blocks(n, k, b):
    # Tails of trimmed blocks and the short last block included: the phase makes them as likely as the rest.
    steps = 6000
    counts = torch.zeros(n)
    for step in range(steps):
        counts[select("random_block", torch.zeros(n), [Unit(0, 0, n)], k / n, seed=5, step=step, block_size=b)] += 1
    expected = steps * k / n
    sd = (steps * (k / n) * (1 - k / n)) ** 0.5
    assert (counts - expected).abs().max() < 5 * sd, (counts.min(), counts.max(), expected)


def test_block_size_is_checked():
    with pytest.raises(ValueError, match=r"`block_size` must be an int >= 1, got 0; it is the number of entries"):
        SparsifyState(block_size=0)


@pytest.mark.parametrize("method", ["randomk", "random_block"])
def test_every_coordinate_is_equally_likely(method):
    n, k, steps = 40, 4, 4000
    counts = torch.zeros(n)
    for step in range(steps):
        counts[select(method, torch.zeros(n), [Unit(0, 0, n)], k / n, seed=5, step=step)] += 1
    expected = steps * k / n  # 400; a start drawn from [0, n-k] would give the edges ~1/k of that
    assert counts.min() > 0.8 * expected and counts.max() < 1.2 * expected


def test_random_choice_is_a_function_of_seed_step_unit_and_rank():
    args = dict(values=torch.zeros(1000), units=[Unit(3, 0, 1000)], density=0.05)
    a = select("randomk", seed=9, step=2, **args)
    assert torch.equal(a, select("randomk", seed=9, step=2, **args))
    assert not torch.equal(a, select("randomk", seed=9, step=3, **args))
    assert not torch.equal(a, select("randomk", seed=9, step=2, rank=1, **args))
    assert derive_seed(9, 2, 3, SHARED) != derive_seed(9, 2, 3, 0)


def test_large_random_subsets_are_uniform_and_distinct():
    from ddp_hooks.sparsify.selectors.draws import random_subsets

    idx = random_subsets([0, 10_000_000], [10_000_000, 500_000], [100_000, 5_000], [1, 2], 0, 0, SHARED,
                         torch.device("cpu"))
    first, second = idx[:100_000], idx[100_000:]
    assert first.unique().numel() == 100_000 and second.unique().numel() == 5_000
    assert first.max() < 10_000_000 <= second.min() and second.max() < 10_500_000
    assert abs(first.double().mean().item() - 5e6) < 3e4  # std of the mean: 2.9e6 / sqrt(1e5) = 9.1e3
    counts = torch.bincount(first // 100_000, minlength=100).double()  # 1000 expected per bin
    assert ((counts - 1000) ** 2 / 1000).sum().item() < 160  # chi-square, 99 dof: p < 1e-4 above 160


def test_a_unit_short_of_draws_keeps_its_first_positions_and_the_others_choose_alike(monkeypatch):
    """A unit whose draws fall short (a chance below 1e-9) keeps its first k positions, read on no host;
    a unit whose draws sufficed chooses as with more draws (the choice is its first k distinct draws)."""
    from ddp_hooks.sparsify.selectors import draws

    args = ([0, 3000, 3100], [3000, 100, 5000], [300, 60, 50], [4, 5, 6], 7, 3, SHARED, torch.device("cpu"))
    expected = draws.random_subsets(*args)
    monkeypatch.setattr(draws, "draws_needed", lambda n, k: k)  # k draws: short unless all k are distinct
    draws.split_units.cache_clear()  # the plans cached above were made with the real number of draws
    try:
        got = draws.random_subsets(*args)
        without_host_reads = draws.random_subsets(*args, reads_on_host=False)
    finally:
        draws.split_units.cache_clear()  # nor may later tests see plans made with too few draws
    assert torch.equal(got, without_host_reads)
    # 300 distinct draws of 3000 (a chance of about e^-15) and 60 of 100 (none): both units fall short
    assert got[:300].tolist() == list(range(300)) and got[300:360].tolist() == list(range(3000, 3060))
    # 50 of 5000 are all distinct with a chance of about e^-0.25: the unit is short or chooses as before
    assert got[360:].tolist() in (expected[360:].tolist(), list(range(3100, 3150)))
    assert not torch.equal(got[:360], expected[:360])


@pytest.mark.parametrize("method", ["randomk", "random_block"])
def test_the_draws_are_the_same_without_host_reads(method):
    """Where no count may be read on the host, kept draws are written to their slots: the same positions."""
    from ddp_hooks.sparsify.selectors.draws import random_subsets
    from ddp_hooks.sparsify.selectors.random_block import random_blocks

    for step in range(20):
        args = ([0, 3000, 3100, 9000], [3000, 100, 5000, 200_000], [300, 60, 50, 3000], [4, 5, 6, 9])
        if method == "randomk":
            draw = lambda host: random_subsets(*args, 7, step, SHARED, torch.device("cpu"), reads_on_host=host)
        else:
            draw = lambda host: random_blocks(*args, 4, 7, step, SHARED, torch.device("cpu"), reads_on_host=host)
        assert torch.equal(draw(True), draw(False))


def test_random_subsets_cover_all_positions_alike_across_steps():
    from ddp_hooks.sparsify.selectors.draws import random_subsets

    # a large unit and a small one, over many steps
    n_big, n_small, counts_big, counts_small = 8192, 40, torch.zeros(8192), torch.zeros(40)
    for step in range(300):
        idx = random_subsets([0, n_big], [n_big, n_small], [400, 4], [0, 1], 5, step, SHARED, torch.device("cpu"))
        counts_big += torch.bincount(idx[:400], minlength=n_big)
        counts_small += torch.bincount(idx[400:] - n_big, minlength=n_small)
    assert counts_big.sum() == 300 * 400 and counts_small.sum() == 300 * 4
    # each position of the big unit: Binomial(300, 400/8192), mean 14.6; a position the sampler
    # favoured or starved would show up in the spread of the counts
    assert abs(counts_big.var().item() - 300 * (400 / 8192) * (1 - 400 / 8192)) < 2.0
    assert counts_small.min() > 10 and counts_small.max() < 50  # mean 30


def test_tensor_mixer_equals_the_python_one():
    from ddp_hooks.sparsify.selectors.draws import splitmix64, splitmix64_tensor, to_signed

    values = [0, 1, 2**62 + 12345, -(2**63), -1, 987654321987654321]
    mixed = splitmix64_tensor(torch.tensor(values)).tolist()
    assert mixed == [to_signed(splitmix64(v & ((1 << 64) - 1))) for v in values]


def test_selection_does_not_touch_the_global_rng():
    state = torch.random.get_rng_state()
    select("randomk", torch.zeros(1000), [Unit(0, 0, 1000)], 0.1, seed=0, step=0)
    assert torch.equal(state, torch.random.get_rng_state())


def test_residuals_follow_their_parameters_across_a_rebuild():
    store = ResidualStore()
    cpu = torch.device("cpu")
    a = store.bucket_residual(0, ((0, 0, 2), (1, 2, 3)), 5, cpu)
    a.copy_(torch.arange(5.0))
    # rebuild: parameter 1 moves to bucket 0 alone, parameter 0 to bucket 1
    b0 = store.bucket_residual(0, ((1, 0, 3),), 3, cpu)
    b1 = store.bucket_residual(1, ((0, 0, 2),), 2, cpu)
    assert b0.tolist() == [2.0, 3.0, 4.0] and b1.tolist() == [0.0, 1.0]
    assert store.total().item() == 10.0


def test_loaded_residual_of_another_model_is_refused():
    store = ResidualStore()
    store.load({0: torch.ones(4)})
    with pytest.raises(ValueError, match="residual of parameter #0 has 4 elements but the parameter has 6"):
        store.bucket_residual(0, ((0, 0, 6),), 6, torch.device("cpu"))


def test_state_dict_loads_with_weights_only(tmp_path):
    st = SparsifyState(method="randomk", density=0.2, seed=4)
    st.residuals.load({0: torch.ones(3)})
    torch.save(st.state_dict(), tmp_path / "s.pt")
    sd = torch.load(tmp_path / "s.pt", weights_only=True)
    other = SparsifyState(method="randomk", density=0.2, seed=4)
    other.load_state_dict(sd)
    assert torch.equal(other.state_dict()["residuals"][0], torch.ones(3))
    with pytest.raises(ValueError, match="saved with method='randomk', density=0.2"):
        SparsifyState(method="randomk", density=0.1, seed=4).load_state_dict(sd)


@pytest.mark.parametrize("n,k", [(1 << 20, 1000), (1 << 20, 60_000), (300_000, 17), (1 << 20, 200_000)])
def test_fast_topk_equals_torch_topk(n, k):
    from ddp_hooks.sparsify.selectors.topk import topk_units

    x = torch.randn(n)
    x[::7] *= 10  # structure aligned with no particular stride
    fast = topk_units(x.abs(), [0], [n], [k])
    exact = torch.topk(x.abs(), k).indices
    assert fast.numel() == k
    assert torch.equal(fast.sort().values, exact.sort().values)


def test_fast_topk_of_many_units_equals_torch_topk_per_unit():
    from ddp_hooks.sparsify.selectors.topk import topk_units

    sizes = [5, 40_000, 100, 70_000, 3, 200_000]
    offsets = [sum(sizes[:i]) + 2 * i for i in range(len(sizes))]  # gaps between units are never chosen
    x = torch.randn(offsets[-1] + sizes[-1]) * torch.linspace(0.1, 10, offsets[-1] + sizes[-1])
    ks = [budget(n, 0.01) for n in sizes]
    got = topk_units(x.abs(), offsets, sizes, ks)
    at = 0
    for o, n, k in zip(offsets, sizes, ks):
        exact = torch.topk(x[o:o + n].abs(), k).indices + o
        assert torch.equal(got[at:at + k].sort().values, exact.sort().values)
        at += k
    assert at == got.numel()


def test_fast_topk_falls_back_when_the_sample_misleads():
    from ddp_hooks.sparsify.selectors.topk import topk_units

    x = torch.zeros(1 << 20)
    # the strided sample sees only zeros; distinct values, so that the top 5000 are one set (uniform floats in
    # [1, 2) tie now and then at the boundary, where both answers are a top-k and the check could fail by chance)
    x[1::2] = torch.randperm(1 << 19, generator=torch.Generator().manual_seed(0)).float() + 1
    fast = topk_units(x.abs(), [0], [1 << 20], [5000], mask=torch.ones(1 << 21, dtype=torch.bool))
    assert torch.equal(fast.sort().values, torch.topk(x.abs(), 5000).indices.sort().values)


def test_a_state_saved_before_block_size_existed_still_loads(caplog):
    # Written by the code of ac086ab (one wrapped block per unit): random_block, density 0.2, seed 3, 3 steps.
    import os

    sd = torch.load(os.path.join(FIXTURES, "sparsify_state_before_block_size.pth"),
                    weights_only=True)
    assert "block_size" not in sd["config"]
    with pytest.raises(ValueError, match=r"saved with .*density_warmup_steps=0, .* but .*density_warmup_steps=1000"):
        SparsifyState(method="random_block", density=0.2, seed=3).load_state_dict(sd)  # it ran no density warm-up
    state = SparsifyState(method="random_block", density=0.2, seed=3, density_warmup_steps=0)
    with caplog.at_level("WARNING", logger="ddp_hooks.sparsify.state"):
        state.load_state_dict(sd)
    assert "saved before block_size, optimizer_momentum existed" in caplog.text
    assert state.step == 3 and torch.equal(state.state_dict()["residuals"][0], sd["residuals"][0])
    with pytest.raises(ValueError, match="saved with method='random_block'"):
        SparsifyState(method="randomk", density=0.2, seed=3).load_state_dict(sd)


def test_a_state_saved_with_another_block_size_is_refused():
    sd = SparsifyState(block_size=16).state_dict()
    with pytest.raises(ValueError, match="saved with .*block_size=16.* but this SparsifyState has .*block_size=8"):
        SparsifyState(block_size=8).load_state_dict(sd)


def test_density_falls_geometrically_after_the_warm_up():
    state = SparsifyState(density=0.01, warmup_steps=10, density_warmup_steps=100)
    assert [state.density_at(s) for s in (0, 9, 10)] == [1.0, 1.0, 1.0]
    assert state.density_at(60) == pytest.approx(0.1) and state.density_at(110) == 0.01
    assert SparsifyState(method="topk", aggregation="allgather").density_warmup_steps == 1000
    assert SparsifyState(method="randomk", density_warmup_steps=0).density_warmup_steps == 0


def test_the_density_warm_up_falls_from_its_start():
    """From 1 by default, for every selector, as before the start was an option (bit for bit)."""
    for method, aggregation in (("random_block", "allreduce"), ("topk", "allgather"), ("shared_topk", "allreduce")):
        state = SparsifyState(method=method, aggregation=aggregation, density=0.01)
        assert state.density_warmup_start == 1.0
        assert SparsifyState(method=method, aggregation=aggregation,
                             density_warmup_start=None).density_warmup_start == 1.0
        assert [state.density_at(s) for s in range(0, 1001, 7)] == [max(0.01, 0.01 ** (s / 1000))
                                                                    for s in range(0, 1001, 7)]
    chosen = SparsifyState(method="shared_topk", density=0.01, density_warmup_start=0.1)
    assert chosen.density_at(0) == pytest.approx(0.1) and chosen.density_at(500) == pytest.approx(0.1 ** 1.5)
    assert chosen.density_at(1000) == 0.01
    short = SparsifyState(method="randomk", density=0.01, density_warmup_start=0.25, density_warmup_steps=100)
    assert short.density_at(0) == 0.25 and short.density_at(50) == pytest.approx(0.05)
    # a start at or below the density is no warm-up
    assert SparsifyState(density=0.2, density_warmup_start=0.1).density_at(0) == 0.2
    with pytest.raises(ValueError, match=r"`density_warmup_start` must be a float in \(0, 1\], got 1.5.*first step"):
        SparsifyState(density_warmup_start=1.5)


def test_a_state_saved_before_the_warm_up_start_existed_resumes_as_from_1_and_another_start_is_refused():
    sd = SparsifyState(method="shared_topk", density_warmup_start=0.1).state_dict()
    assert sd["config"]["density_warmup_start_bits"] == float_to_bits(0.1)
    with pytest.raises(ValueError, match=r"differing: density_warmup_start\).*density_warmup_start=0.1.*but this "
                                         r"SparsifyState has .*density_warmup_start=1"):
        SparsifyState(method="shared_topk").load_state_dict(sd)
    older = SparsifyState(method="shared_topk").state_dict()
    del older["config"]["density_warmup_start_bits"]  # saved before the option: its warm-up fell from 1
    SparsifyState(method="shared_topk").load_state_dict(older)
    with pytest.raises(ValueError, match=r"differing: density_warmup_start\)"):
        SparsifyState(method="shared_topk", density_warmup_start=0.1).load_state_dict(older)


def test_block_size_matters_to_random_block_only_when_loading():
    """A random-k or top-k state saved when block_size defaulted to 16 resumes under today's default."""
    for method, aggregation in (("randomk", "allreduce"), ("topk", "allgather")):
        sd = SparsifyState(method=method, aggregation=aggregation, block_size=16).state_dict()
        state = SparsifyState(method=method, aggregation=aggregation)
        state.load_state_dict(sd)
        assert state.block_size == 4 and state.step == sd["step"]
    with pytest.raises(ValueError, match="block_size=16.* but this SparsifyState has .*block_size=4"):
        SparsifyState(method="random_block").load_state_dict(SparsifyState(block_size=16).state_dict())


def test_a_refused_state_names_the_options_that_differ():
    sd = SparsifyState(density=0.05, block_size=16).state_dict()
    with pytest.raises(ValueError, match=r"differing: block_size, density\).*default block_size was 16"):
        SparsifyState(density=0.01).load_state_dict(sd)
    with pytest.raises(ValueError, match=r"differing: seed\)") as refused:
        SparsifyState(seed=5).load_state_dict(SparsifyState(seed=6).state_dict())
    assert "block_size was 16" not in str(refused.value)

"""Non-finite gradients and the AMP loss scale in sparsify_hook (2 gloo ranks).

The rule under test: when any rank's gradient holds inf or NaN at a step,
every rank's output is non-finite, every rank's residuals keep their values
from before the step, the step counter advances alike, and training goes on
with equal replicas; so a run with a NaN injected at step t equals a run
that skipped step t (its counter advanced) bit for bit.
"""

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_hooks import SparsifyState, sparsify_hook
from ddp_hooks.sparsify import compressor
from ddp_hooks.testing import assert_replicas_equal, run_distributed
from small_mlp import COMBOS, batch, small_mlp

BAD_STEP = 2


def _poison_first_layer(model, value):
    """A tensor hook that puts `value` into one entry of the first layer's weight gradient.

    That layer sits in DDP's last bucket (buckets follow the reverse order of
    the parameters), so the earlier buckets were exchanged before the
    non-finite value shows up: the whole step must be discarded all the same.
    """
    def poison(g):
        g = g.clone()
        g.view(-1)[3] = value
        return g

    return model.module[0].weight.register_hook(poison)


# momentum and weight decay in the hook: the velocities must be discarded with the step too
IN_HOOK = {"momentum": 0.9, "weight_decay": 5e-4}
MOMENTUM_COMBOS = [("random_block", "layer", "allreduce"), ("randomk", "global", "allgather")]


def _train_with_bad_step(rank, method, scope, aggregation, skip, value, steps=5, hook=None):
    model = DDP(small_mlp(), bucket_cap_mb=0.002)
    state = SparsifyState(method=method, density=0.1, scope=scope, aggregation=aggregation, seed=5,
                          density_warmup_steps=0, **(hook or {}))
    model.register_comm_hook(state, sparsify_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    seen = {}
    for step in range(steps):
        if step == BAD_STEP and skip:  # the reference: the step never happened, its counter did
            state.step += 1
            continue
        handle = _poison_first_layer(model, value) if step == BAD_STEP and rank == 1 else None
        before = state.residuals.state()
        velocities_before = state.velocities.state()
        opt.zero_grad()
        model(batch(rank, step)).pow(2).mean().backward()
        if handle is not None:
            handle.remove()
        if step == BAD_STEP:
            after = state.residuals.state()
            seen["output_nonfinite"] = not all(torch.isfinite(p.grad).all() for p in model.parameters())
            seen["residual_kept"] = before.keys() == after.keys() and all(
                torch.equal(before[k], after[k]) for k in before)
            velocities_after = state.velocities.state()
            seen["velocity_kept"] = velocities_before.keys() == velocities_after.keys() and all(
                torch.equal(velocities_before[k], velocities_after[k]) for k in velocities_before)
            continue  # what GradScaler does with a non-finite gradient
        opt.step()
    seen["residual_finite"] = all(torch.isfinite(t).all() for t in state.residuals.state().values())
    seen["step"], seen["nonfinite_steps"] = state.step, state.stats()["nonfinite_steps"]
    assert_replicas_equal(model)
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return params, {**state.residuals.state(), **{-1 - k: v for k, v in state.velocities.state().items()}}, seen


def _nan_on_one_rank(rank, world):
    out = {}
    runs = [(combo, None) for combo in COMBOS] + [(combo, IN_HOOK) for combo in MOMENTUM_COMBOS]
    for i, (combo, hook) in enumerate(runs):
        value = float("nan") if i % 2 == 0 else float("-inf")
        params, states, seen = _train_with_bad_step(rank, *combo, skip=False, value=value, hook=hook)
        ref_params, ref_states, _ = _train_with_bad_step(rank, *combo, skip=True, value=value, hook=hook)
        seen["same_as_skipped"] = torch.equal(params, ref_params) and states.keys() == ref_states.keys() and all(
            torch.equal(states[k], ref_states[k]) for k in ref_states)
        out[(*combo, hook is not None)] = seen
    return out


def test_nonfinite_gradient_on_one_rank_discards_the_step_on_every_rank():
    for rank, results in enumerate(run_distributed(_nan_on_one_rank, 2, timeout=300)):
        for combo, seen in results.items():
            assert seen["output_nonfinite"], (rank, combo)  # so GradScaler skips on every rank
            assert seen["residual_kept"] and seen["velocity_kept"], (rank, combo)
            assert seen["residual_finite"], (rank, combo)
            assert seen["step"] == 5 and seen["nonfinite_steps"] == 1, (rank, combo, seen)
            assert seen["same_as_skipped"], (rank, combo)


SCALER_COMBOS = [("topk", "layer", "allgather", False), ("random_block", "global", "allreduce", False),
                 ("randomk", "bucket", "allgather", False), ("random_block", "layer", "allreduce", True)]
INF_STEPS = (3,)


def _scaled_run(rank, method, scope, aggregation, in_hook, mode, steps=8):
    """mode: "reference" (no scaler, inf steps skipped), "attached" (scaler given to the state), "unattached"."""
    model = DDP(small_mlp(), bucket_cap_mb=0.002)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2)
    state = SparsifyState(method=method, scope=scope, aggregation=aggregation, density=0.1, density_warmup_steps=0,
                          grad_scaler=scaler if mode == "attached" else None, **(IN_HOOK if in_hook else {}))
    model.register_comm_hook(state, sparsify_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scales = []
    for step in range(steps):
        x = batch(rank, step)
        if mode == "reference":
            if step in INF_STEPS:
                state.step += 1
                continue
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
            continue
        if step in INF_STEPS and rank == 1:
            x[0, 0] = float("inf")
        opt.zero_grad()
        scaler.scale(model(x).pow(2).mean()).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), scales


def _grad_scaler_runs(rank, world):
    out = {}
    for combo in SCALER_COMBOS:
        ref, _ = _scaled_run(rank, *combo, "reference")
        attached, scales = _scaled_run(rank, *combo, "attached")
        unattached, _ = _scaled_run(rank, *combo, "unattached")
        out[combo] = {"attached_equal": torch.equal(attached, ref), "scales": scales,
                      "unattached_diff": (unattached - ref).abs().max().item()}
    return out


def test_grad_scaler_training_equals_training_without_a_scaler():
    for results in run_distributed(_grad_scaler_runs, 2, timeout=300):
        for combo, r in results.items():
            # growth every 2 good steps, halving at the inf step: the scale moved both ways
            assert r["scales"] == [256.0, 512.0, 512.0, 256.0, 256.0, 512.0, 512.0, 1024.0], (combo, r["scales"])
            # powers of two scale exactly: bit for bit the run without a scaler that skipped the inf step
            assert r["attached_equal"], combo
            # the control: residuals left scaled drift by S_new / S_old at every change of scale
            assert r["unattached_diff"] > 1e-4, (combo, r["unattached_diff"])


def test_fill_if_sync_free_path_matches_the_host_path(monkeypatch):
    """The masked_fill_ path runs on GPUs only; check it here on CPU tensors."""
    for flag in (True, False):
        for host_reads in (True, False):
            monkeypatch.setattr(compressor, "HOST_READS_ON_CPU", host_reads)
            t = torch.arange(5.0)
            compressor.fill_if(t, torch.tensor(flag), float("nan"))
            assert torch.isnan(t).all() if flag else torch.equal(t, torch.arange(5.0))


def test_scan_tells_zero_finite_and_nonfinite_gradients_apart():
    """Marks 0 (no gradient), 1 (finite gradient), NaN (inf or NaN) for every dtype and every path of the scan."""
    from ddp_hooks.sparsify.hook import scan

    late = torch.zeros(6)
    late[4] = -2.0  # first entry zero, gradient not: found among the entries spread over the parameter
    hidden = torch.zeros(10, 10)
    hidden[5, 0] = 3.0  # first entry and the spread entries zero: found only by reading the whole parameter
    nan, inf = torch.ones(5), torch.ones(2, 2)
    nan[1], inf[0, 1] = float("nan"), float("-inf")
    big = torch.full((4, 3), 1e20)  # finite, but its squares overflow float32
    huge = torch.full((3,), 3e38)  # finite, but its float32 sum overflows: measured again per parameter
    cases = {  # name: (gradients, expected marks; None for NaN)
        "finite": ([torch.zeros(7), big, torch.randn(3), torch.zeros(0), late, torch.full((2,), 1e-30), hidden],
                   [0, 1, 1, 0, 1, 1, 1]),
        "nan and inf": ([torch.zeros(7), nan, torch.randn(3), inf, late], [0, None, 1, None, 1]),
        "sum overflows": ([huge, torch.zeros(2), torch.randn(3)], [1, 0, 1]),
        "empty last": ([torch.randn(3), torch.zeros(0)], [1, 0]),
    }
    for dtype in (torch.float32, torch.float64, torch.bfloat16):  # the one-pass path and the aminmax path
        for name, (grads, expected) in cases.items():
            if dtype == torch.bfloat16 and name == "sum overflows":
                continue
            buffer = torch.cat([g.reshape(-1) for g in grads]).to(dtype)
            views = list(buffer.split([g.numel() for g in grads]))
            views = [v.view(g.shape) for v, g in zip(views, grads)]
            starts = torch.tensor([0] + [g.numel() for g in grads[:-1]]).cumsum(0)
            marks = scan(buffer, views, starts)
            assert marks.dtype == torch.float32 and marks.shape == (len(grads),), (dtype, name, marks)
            for got, want in zip(marks.tolist(), expected):
                assert (got != got) if want is None else got == want, (dtype, name, marks)


def test_received_values_are_judged_by_their_entries_not_by_their_sum():
    from ddp_hooks.sparsify.compressor import holds_nonfinite

    nan, inf = torch.ones(6), torch.ones(6)
    nan[4], inf[2] = float("nan"), float("inf")
    cases = [(torch.randn(6), False), (torch.full((4,), 3e38), False),  # finite: a float32 sum that overflows
             (nan, True), (inf, True), (torch.zeros(0), False), (torch.full((3, 2), 6e4, dtype=torch.float16), False)]
    for values, expected in cases:
        got = holds_nonfinite(values)
        assert got.dtype == torch.bool and got.dim() == 0 and bool(got) == expected, (values, got)
    assert bool(holds_nonfinite(inf.half())) and bool(holds_nonfinite(nan.to(torch.bfloat16)))

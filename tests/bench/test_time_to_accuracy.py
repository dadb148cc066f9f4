"""bench/ time-to-accuracy: the plan, the product of steps and step times, the report, and a short run of the
training loop on 2 gloo ranks over a tiny Fashion-MNIST folder in the real on-disk format."""

from __future__ import annotations

import dataclasses
import doctest
import json
import math
import os
import sys

import pytest

from fashion_folder import write_fashion_folder
from paths import BENCH, RECIPES

sys.path.insert(0, RECIPES)
sys.path.insert(0, BENCH)

import bench_models  # noqa: E402
import tta_plan  # noqa: E402
import tta_report  # noqa: E402
from cluster_plan import ALLREDUCE, NOOP, POWERSGD, SYNC_ADAGRAD, sparsifier  # noqa: E402


@pytest.mark.parametrize("module", [bench_models, tta_plan, tta_report], ids=lambda m: m.__name__)
def test_docstring_examples(module):
    assert doctest.testmod(module).failed == 0


def test_step_time_rows_cover_each_selector_down_to_its_lowest_density():
    rows = tta_plan.step_time_methods(tta_plan.curve_methods())
    assert rows[0].label == NOOP.label and len(set(rows)) == len(rows)
    grid = [0.01, 0.05, 0.1, 0.2, 0.3, 0.99]
    for name in ("topk", "randomk", "random_block", "shared_topk"):  # each density warm-up starts at 1
        assert sorted(r.density for r in rows if r.method == name and r.value_dtype is None) == grid
    # values sent as float16 change the step time: the variant is timed over the grid as a selector of its own
    halves = [r for r in rows if r.value_dtype == "float16"]
    assert sorted(r.density for r in halves) == sorted(grid * 2)
    assert {r.method for r in halves} == {"random_block", "shared_topk"}
    # a warm-up from 0.1 is timed up to the grid's 0.1 only
    low = [m for m in tta_plan.warmup_candidates() if m.label == "shared top-k d=0.01 warm-up 1000 from 0.1"]
    assert [r.density for r in tta_plan.step_time_methods(low)[1:]] == [0.1, 0.05, 0.01]
    assert len({tta_plan.method_key(r) for r in halves} & {tta_plan.method_key(r) for r in rows if r not in halves}) == 0
    assert not any(r.hook == "sparsify" and r.label.endswith("d=0.01") for r in rows)  # grid rows: plain labels
    quick = tta_plan.step_time_methods(tta_plan.curve_methods(quick=True))
    assert [r.label for r in quick][:2] == ["noop hook (no exchange)", "allreduce hook"]


def test_step_times_are_taken_with_the_optimizer_settings_the_curves_train_with():
    """The sparsifier's momentum path (velocity, last update, decay) is work of its own: timing a method without
    the momentum it trains with made the product 25 % short of the wall clock at 1 Gbit/s."""
    rows = {(r.label, r.density): r for r in tta_plan.step_time_methods(tta_plan.curve_methods())}
    rows = {f"{label} d={density}" if density else label: r for (label, density), r in rows.items()}
    for label in ("noop hook (no exchange)", "allreduce hook", "PowerSGD rank 4", "random-block d=0.01"):
        trained = tta_plan.training_args(rows[label])
        args = rows[label].recipe_args()
        assert (args.momentum, args.weight_decay) == (trained.momentum, trained.weight_decay) == (0.9, 5e-4), label
    for label in ("sync AdaGrad", "Local AdaAlter H=4"):
        assert (rows[label].recipe_args().momentum, rows[label].recipe_args().weight_decay) == (0.0, 0.0)


def test_training_args_use_each_familys_settings_and_the_default_density_warmup():
    from comm_setup import build_exchange

    sgd = tta_plan.training_args(sparsifier("random_block", 0.01, "layer", "allreduce"))
    assert (sgd.lr, sgd.momentum, sgd.weight_decay, sgd.density_warmup_steps) == (0.05, 0.9, 5e-4, None)
    assert build_exchange(sgd).state.options.density_warmup_steps == 1000
    adagrad = tta_plan.training_args(SYNC_ADAGRAD)
    assert (adagrad.lr, adagrad.eps, adagrad.momentum, adagrad.weight_decay) == (0.1, 1.0, 0.0, 0.0)
    assert tta_plan.learning_rate(ALLREDUCE, 0, 100) == 0.05
    assert tta_plan.learning_rate(ALLREDUCE, 50, 100) == pytest.approx(0.025)
    assert tta_plan.learning_rate(SYNC_ADAGRAD, 99, 100) == 0.1


def _record(method, bandwidth, seconds, **extra):
    return {"model": "fmnist-cnn", "hosts": 4, "bandwidth": bandwidth, "round": 0, **method.as_dict(), "params": 1227786,
            "s_per_step": seconds, "s_per_step_max_rank": seconds, "payload_bytes_per_step": 1.0,
            "wire_bytes_per_step": 1.0, "dense_bytes_per_step": 1.0, "forward_s": 0.01, "backward_s": 0.02,
            "exchange_s": 0.03, "compression_s": 0.004, "optimizer_s": 0.001, **extra}


def _step_times():
    records = [_record(NOOP, "1gbit", 0.1), _record(ALLREDUCE, "1gbit", 0.5), _record(POWERSGD[4], "1gbit", 0.2)]
    records += [_record(sparsifier("random_block", d, "layer", "allreduce"), "1gbit", t)
                for d, t in ((1.0, 0.6), (0.1, 0.3), (0.01, 0.15))]
    return tta_report.StepTimes(records)


def test_time_to_a_step_integrates_the_density_warmup_and_counts_dense_warmups():
    times = _step_times()
    block = tta_plan.curve_methods(quick=True)[1]
    assert block.label == "random-block d=0.01"
    # step 0 sends at density 1, step 500 at 0.1, from step 1000 on at 0.01
    assert times.seconds("1gbit", block, 1) == pytest.approx(0.6)
    options_density = [0.01 ** (s / 1000) for s in range(1000)]
    expected = sum(tta_report.interpolate([(1.0, 0.6), (0.1, 0.3), (0.01, 0.15)], d) for d in options_density)
    assert times.seconds("1gbit", block, 1200) == pytest.approx(expected + 200 * 0.15)
    assert times.seconds("1gbit", POWERSGD[4], 10) == pytest.approx(2 * 0.5 + 8 * 0.2)  # 2 dense steps first
    assert times.seconds("1gbit", ALLREDUCE, 10) == pytest.approx(5.0)
    assert times.seconds("100mbit", ALLREDUCE, 10) is None
    assert times.noop("1gbit") == 0.1


def test_top_k_warmup_interpolates_each_side_of_its_turn_to_allreduce_apart():
    # at 4 hosts top-k under AllGather sends everything by AllReduce from density 1/4 (timed at 0.99 and 0.3),
    # and gathers below (timed at 0.2 and 0.01): a density of 0.25 costs the AllReduce path's 0.4 s, one of
    # 0.24 the gather's 0.9 s (held from 0.2), not a blend of the two
    topk = dataclasses.replace(sparsifier("topk", 0.01, "layer", "allgather"), density_warmup_start=1.0)
    times = tta_report.StepTimes([_record(sparsifier("topk", d, "layer", "allgather"), "1gbit", t)
                                  for d, t in ((0.99, 0.4), (0.3, 0.4), (0.2, 0.9), (0.01, 0.1))])
    densities = [tta_report.sparsify_options(topk).density_at(s) for s in range(1000)]
    expected = sum(0.4 if d >= 0.25 else tta_report.interpolate([(0.2, 0.9), (0.01, 0.1)], d) for d in densities)
    assert times.seconds("1gbit", topk, 1000) == pytest.approx(expected)
    assert sum(d >= 0.25 for d in densities) == 302  # the first 302 steps


def test_warmup_variants_train_and_are_timed_with_their_own_density_warmup():
    short, none, shared_none = tta_plan.warmup_variants()
    assert all(m not in tta_plan.curve_methods() for m in tta_plan.warmup_candidates())
    assert (short.label, none.label) == ("random-block d=0.01 warm-up 250", "random-block d=0.01 warm-up 0")
    assert (shared_none.method, shared_none.density_warmup) == ("shared_topk", 0)
    assert short in tta_plan.curve_methods() and none in tta_plan.curve_methods()
    assert tta_plan.training_args(short).density_warmup_steps == 250
    assert tta_plan.training_args(none).density_warmup_steps == 0
    assert short.recipe_args().density_warmup_steps == 0  # the cluster times a constant density
    times = _step_times()
    assert times.seconds("1gbit", none, 300) == pytest.approx(300 * 0.15)
    expected = sum(tta_report.interpolate([(1.0, 0.6), (0.1, 0.3), (0.01, 0.15)], 0.01 ** (s / 250))
                   for s in range(250))
    assert times.seconds("1gbit", short, 300) == pytest.approx(expected + 50 * 0.15)
    # the warm-up variants add curves, not cluster rows (each selector's float16-values variant adds its grid)
    assert len(tta_plan.step_time_methods(tta_plan.curve_methods())) == 26 + 6 + 6 + 6


def _curve(label, method, accuracies, step=100):
    return {"label": label, "method": method.as_dict(), "steps_per_epoch": 200, "epochs": 2, "train": 1, "world": 4,
            "seed": 0, "curve": [{"step": step * (i + 1), "epoch": step * (i + 1) / 200, "accuracy": a,
                                  "train_s": 1.0, "payload_bytes": 10 ** 6 * (i + 1), "loss": 0.5}
                                 for i, a in enumerate(accuracies)]}


def test_report_names_the_target_the_speedups_and_the_methods_that_never_reach_it(tmp_path):
    curves, steps = tmp_path / "c.jsonl", tmp_path / "s.jsonl"
    block = tta_plan.curve_methods(quick=True)[1]
    runs = [_curve("allreduce hook", ALLREDUCE, [80.0, 89.5, 90.0]),
            _curve("PowerSGD rank 4", POWERSGD[4], [70.0, 80.0, 85.0]),
            _curve(block.label, block, [80.0, 89.0, 89.2])]
    curves.write_text("\n".join(json.dumps(r) for r in [{"command": "c", "train": 1, "epochs": 2, "eval_every": 100,
                                                          "world": 4}] + runs) + "\n")
    times = _step_times()
    steps.write_text("\n".join(json.dumps(r) for rows in times.rows.values() for r in rows)
                     + "\n" + json.dumps({"run": {"command": "s"}}) + "\n")
    wall = dict(runs[2], bandwidth="1gbit", curve=[dict(runs[2]["curve"][1], train_s=50.0)])
    text = tta_report.report(str(curves), str(steps), [wall])
    assert "target 89.00 %" in text
    dense_s = 200 * 0.5
    block_s = times.seconds("1gbit", block, 200)
    assert f"| allreduce hook | 0.500 | 5.00 | 10 / 20 / 30 / 4 | 1.0 | {dense_s:.0f} | 1.00x |" in text
    assert f"| {block.label} | 0.150 | 1.50 |" in text and f"{dense_s / block_s:.2f}x" in text
    assert "| PowerSGD rank 4 | 0.200 | 2.00 | 10 / 20 / 30 / 4 | never | never |  | 85.00 (-5.00) |  |\n" in text
    assert all(line.count("|") == 10 for line in text.splitlines() if line.startswith("| "))  # 9 columns
    assert "(not timed)" in text  # no 100mbit rows
    assert f"measured / product = {50.0 / block_s:.2f}" in text
    png = tmp_path / "tta.png"
    pytest.importorskip("matplotlib")
    tta_report.plot(str(curves), str(steps), str(png))
    assert png.stat().st_size > 0


def test_the_target_needs_the_allreduce_run():
    with pytest.raises(ValueError, match="no 'allreduce hook' run"):
        tta_report.target_of([_curve("PowerSGD rank 4", POWERSGD[4], [1.0])])


# ----- the training loop on 2 gloo ranks -----
def _train(rank, world, spec):
    import tta_training

    return tta_training.train_curve(rank, world, spec)


@pytest.mark.parametrize("label", ["random-block d=0.01", "Local AdaAlter H=4"])
def test_training_evaluates_on_schedule_counts_bytes_and_stops_at_the_target(tmp_path, label):
    from ddp_hooks.testing import run_distributed

    write_fashion_folder(str(tmp_path), n_train=128, n_test=20)
    method = next(m for m in tta_plan.curve_methods() if m.label == label)
    spec = {"method": method.as_dict(), "epochs": 2, "train": 128, "eval_every": 1, "seed": 0,
            "data_dir": str(tmp_path), "stop_at": None}
    full = run_distributed(_train, 2, spec, timeout=240)[0]
    assert full["steps_per_epoch"] == 2 and [p["step"] for p in full["curve"]] == [1, 2, 3, 4]
    assert [p["epoch"] for p in full["curve"]] == [0.5, 1.0, 1.5, 2.0]
    payload = [p["payload_bytes"] for p in full["curve"]]
    assert payload == sorted(payload) and payload[-1] > 0
    assert all(math.isfinite(p["loss"]) and 0 <= p["accuracy"] <= 100 for p in full["curve"])
    stopped = run_distributed(_train, 2, dict(spec, stop_at=full["curve"][1]["accuracy"]), timeout=240)[0]
    first = next(i for i, p in enumerate(full["curve"]) if p["accuracy"] >= full["curve"][1]["accuracy"])
    assert len(stopped["curve"]) == first + 1  # the same trajectory, cut at the first evaluation that reaches it
    assert [p["accuracy"] for p in stopped["curve"]] == [p["accuracy"] for p in full["curve"][:first + 1]]


def _sharded_and_whole(rank, world, name):
    import torch

    import tta_training

    torch.manual_seed(0)
    model = bench_models.build_bench_model(name, width=4)
    x = torch.randn(23, 1, 28, 28, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 10, (23,), generator=torch.Generator().manual_seed(2))
    if name == "fmnist-resnet20":  # running statistics unlike any one batch's: eval mode and train mode differ
        with torch.no_grad():
            model(3 * x + 1)
    model.eval()
    whole = 100.0 * int((model(x).argmax(1) == y).sum()) / len(y)
    model.train()
    sharded = tta_training.sharded_accuracy(model, x, y, rank, world)
    return sharded, whole, model.training


@pytest.mark.parametrize("name", bench_models.FASHION_MNIST_MODELS)
def test_each_rank_classifies_its_share_and_the_counts_add_up_to_the_whole_test_set(name):
    """Batch norm (fmnist-resnet20) classifies with its running statistics, and the model goes back to training."""
    from ddp_hooks.testing import run_distributed

    results = run_distributed(_sharded_and_whole, 3, name, timeout=120)  # 23 images: shares of 8, 8 and 7
    assert all(sharded == results[0][1] and training for sharded, _, training in results)
    assert 0 < results[0][1] < 100


# ----- the language model part: Local AdaAlter against sync AdaGrad to a perplexity -----
def test_language_part_docstring_examples_and_plan():
    import tta_language

    assert doctest.testmod(tta_language).failed == 0
    (run,) = tta_language.lm_step_time_plan()
    assert run.model == "fortunes-lstm" and run.hosts == 4
    assert [m.label for m in run.methods] == ["noop hook (no exchange)", "sync AdaGrad", "Local AdaAlter H=4",
                                              "Local AdaAlter H=8", "Local AdaAlter H=8, shared top-k 0.05",
                                              "Local AdaAlter H=16, shared top-k 0.01"]
    sparse = run.methods[-1].recipe_args()
    assert (sparse.sync, sparse.sync_density, sparse.compress_accumulators, sparse.period) == \
        ("shared_topk", 0.01, True, 16)


def test_language_report_charges_the_warmup_at_sync_adagrads_step_time(tmp_path):
    import tta_language
    from cluster_plan import ADAALTER

    curves = tmp_path / "lm.jsonl"
    lines = [{"command": "python bench/bench_adaalter_convergence.py --task fortunes --world 4"}]
    for seed, shift in ((0, 0.0), (1, 0.2)):
        lines += [{"seed": seed, "name": "sync AdaGrad", "curve": [13.0 + shift, 10.0 + shift, 9.0 + shift]},
                  {"seed": seed, "name": "LAA H=4 rate", "curve": [12.0 + shift, 9.05 + shift, 8.9 + shift]},
                  {"seed": seed, "name": "LAA H=8 rate", "curve": [14.0, 13.0, 12.0]},
                  {"seed": seed, "name": "LAA H=4 paper", "curve": [1.0, 1.0, 1.0]},  # not the default rule
                  {"seed": seed, "name": "LAA H=16 rate w0 shared_topk d=0.01", "curve": [11.0, 9.0, 8.0]}]
    curves.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    steps = tmp_path / "s.jsonl"
    records = [dict(_record(m, bw, t), model="fortunes-lstm") for bw in ("1gbit", "100mbit")
               for m, t in ((NOOP, 0.05), (SYNC_ADAGRAD, 0.2), (ADAALTER[4], 0.1), (ADAALTER[8], 0.08),
                            (tta_language.LM_RUNS["LAA H=16 rate w0 shared_topk d=0.01"], 0.06))]
    steps.write_text("\n".join(json.dumps(r) for r in records) + "\n" + json.dumps({"run": {"command": "s"}}) + "\n")
    text = "\n".join(tta_language.lm_report(str(steps), str(curves)))
    assert "shared top-k 0.05" not in text  # no curve in this file: no row
    assert "target: sync AdaGrad's final validation perplexity 9.100" in text
    sync_s = 3 * 96 * 0.2  # sync AdaGrad reaches its own final mean at epoch 3
    laa_s = 32 * 0.2 + (3 * 96 - 32) * 0.1  # LAA H=4's mean after epoch 2 is 9.15, above the target: epoch 3
    assert f"| 1gbit | sync AdaGrad | 0.200 | 4.00 | 3 | {sync_s:.1f} | 1.00x | 9.100 |" in text
    assert f"| 1gbit | Local AdaAlter H=4 | 0.100 | 2.00 | 3 | {laa_s:.1f} | {sync_s / laa_s:.2f}x | 9.000 |" in text
    assert "| 100mbit | Local AdaAlter H=8 | 0.080 | 1.60 | never | never |  | 12.000 |" in text
    sparse_s = 2 * 96 * 0.06  # no warm-up: every step at its own time; 9.0 <= 9.1 after epoch 2
    assert (f"| 1gbit | Local AdaAlter H=16, shared top-k 0.01 | 0.060 | 1.20 | 2 | {sparse_s:.1f} | "
            f"{sync_s / sparse_s:.2f}x | 8.000 |") in text


def test_the_benchmark_lstm_is_the_adaalter_benchmarks_and_fits_the_debian_corpus():
    from bench_adaalter_convergence import char_lstm

    model = bench_models.build_bench_model("fortunes-lstm")
    assert sum(p.numel() for p in model.parameters()) == 120944
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in char_lstm(112, 0).named_parameters()]
    from fortunes_text import DEBIAN_FORTUNES, load_fortunes

    if not os.path.isdir(DEBIAN_FORTUNES):
        pytest.skip("Debian's fortunes files are not installed (apt-get install fortunes)")
    assert len(load_fortunes()[2]) == bench_models.FORTUNES_VOCAB


def test_report_of_another_seed_takes_the_main_runs_step_times(tmp_path):
    """``--report --step-times``: curves of another seed multiplied by the committed run's step times."""
    import shutil

    import bench_time_to_accuracy

    results = os.path.join(os.path.dirname(BENCH), "bench", "results")
    shutil.copy(os.path.join(results, "tta-seed1-curves.jsonl"), tmp_path / "other-curves.jsonl")
    prefix = str(tmp_path / "other")
    bench_time_to_accuracy.write_report(bench_time_to_accuracy.parse_args(["--report", "--results", prefix]))
    assert not os.path.exists(prefix + ".md")  # no step times of its own: nothing to multiply by
    bench_time_to_accuracy.write_report(bench_time_to_accuracy.parse_args(
        ["--report", "--results", prefix, "--step-times", os.path.join(results, "tta-step-times.jsonl")]))
    with open(prefix + ".md") as f:
        text = f.read()
    assert "| random-block d=0.01 float16 values | 0.102 |" in text and "(not timed)" not in text


def test_only_picks_plan_methods_and_warmup_candidates_and_refuses_other_labels():
    import bench_time_to_accuracy

    args = bench_time_to_accuracy.parse_args(["--only", "allreduce hook", "shared top-k d=0.01 warm-up 1000 from 0.1"])
    assert [m.label for m in bench_time_to_accuracy.chosen_methods(args)] == [
        "allreduce hook", "shared top-k d=0.01 warm-up 1000 from 0.1"]
    with pytest.raises(SystemExit, match=r"--only: \['no such method'\] not in the plan"):
        bench_time_to_accuracy.chosen_methods(bench_time_to_accuracy.parse_args(["--only", "no such method"]))

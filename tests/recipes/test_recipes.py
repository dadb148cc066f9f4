"""recipes/ without processes: flag validation, models, data (synthetic, CIFAR on disk, augmentation), metrics, plot."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from paths import RECIPES

sys.path.insert(0, RECIPES)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cifar_data  # noqa: E402
import cifar_models  # noqa: E402
import run_metrics  # noqa: E402
import train_cifar  # noqa: E402
from test_recipes_distributed import write_cifar_folder  # noqa: E402


def _args(*argv, cuda=False):
    args = train_cifar.build_parser().parse_args(list(argv))
    train_cifar.validate_args(args, cuda_available=cuda)
    return args


# ----- flags -----
@pytest.mark.parametrize("argv, match", [
    (["--optimizer", "local_adaalter"], "local_adaalter and --hook local_sgd go together"),
    (["--hook", "local_sgd"], "local_adaalter and --hook local_sgd go together"),
    (["--hook", "sparsify", "--method", "topk"], "topk needs --aggregation allgather"),
    (["--hook", "sparsify", "--density", "0"], r"--density must be in \(0, 1\]"),
    (["--hook", "sparsify", "--density", "1.5"], r"--density must be in \(0, 1\]"),
    (["--amp"], "--amp needs a CUDA device"),
    (["--device", "cuda"], "no CUDA device is available"),
    (["--backend", "nccl"], "--backend nccl needs --device cuda"),
    (["--density", "0.1"], "--density applies to --hook sparsify only"),
    (["--powersgd-rank", "2"], "--powersgd-rank applies to --hook powersgd only"),
    (["--period", "4"], "--period applies to --optimizer local_adaalter only"),
    (["--outer-lr", "0.7"], "--outer-lr applies to --optimizer local_adaalter only"),
    (["--hook", "local_sgd", "--optimizer", "local_adaalter", "--outer-lr", "0"], "--outer-lr must be > 0"),
    (["--hook", "local_sgd", "--optimizer", "local_adaalter", "--outer-momentum", "1"],
     r"--outer-momentum must be in \[0, 1\)"),
    (["--lazy-correction", "rate"], "--lazy-correction applies to --optimizer local_adaalter only"),
    (["--sync", "shared_topk"], "--sync applies to --optimizer local_adaalter only"),
    (["--hook", "local_sgd", "--optimizer", "local_adaalter", "--sync", "shared_topk", "--sync-density", "0"],
     r"--sync-density must be in \(0, 1\]"),
    (["--hook", "local_sgd", "--optimizer", "local_adaalter", "--compress-accumulators"],
     "--compress-accumulators needs a sparse --sync"),
    (["--hook", "local_sgd", "--optimizer", "local_adaalter", "--period", "4", "--accumulator-period", "6"],
     "--accumulator-period must be a positive multiple of --period 4"),
    (["--hook", "local_sgd", "--optimizer", "local_adaalter", "--period", "4", "--accumulator-period", "-4"],
     "--accumulator-period must be a positive multiple of --period 4"),
    (["--optimizer", "adagrad", "--momentum", "0.9"], "--momentum applies to --optimizer sgd only"),
    (["--no-error-feedback"], "--no-error-feedback applies to --hook sparsify only"),
    (["--nodes", "2"], "--nodes applies to --hook sparsify only"),
    (["--hook", "powersgd", "--warmup-steps", "1"], "needs --warmup-steps >= 2"),
    (["--data", "cifar10"], "--data cifar10 needs --data-dir"),
    (["--download"], "apply to --data cifar10 only"),
    (["--data", "cifar10", "--data-dir", "x", "--download", "--cifar-skip-md5"], "exclude each other"),
    (["--resume"], "--resume needs --out-dir"),
    (["--epochs", "2", "--stop-after", "3"], "exceeds --epochs"),
    (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--lr", "0"], "--lr must be > 0"),
    (["--lr-milestones", "1"], "--lr-milestones applies to --lr-schedule step only"),
])
def test_invalid_combinations_are_refused(argv, match):
    with pytest.raises(ValueError, match=match):
        _args(*argv)


def test_parse_args_exits_with_the_message(capsys):
    with pytest.raises(SystemExit) as info:
        train_cifar.parse_args(["--hook", "sparsify", "--density", "2"])
    assert info.value.code == 2
    assert "--density must be in (0, 1]" in capsys.readouterr().err


def test_defaults_of_owned_options_are_filled_for_their_owner_only():
    sparse = _args("--hook", "sparsify")
    assert (sparse.method, sparse.density, sparse.scope, sparse.aggregation) == ("random_block", 0.01, "layer",
                                                                                  "allreduce")
    assert sparse.momentum == 0.9 and sparse.powersgd_rank is None and sparse.eps is None
    ada = _args("--hook", "local_sgd", "--optimizer", "local_adaalter")
    assert ada.period == 8 and ada.eps == 1.0 and ada.momentum is None and ada.density is None
    assert (ada.lazy_correction, ada.outer_lr, ada.outer_momentum) == (None, 1.0, 0.0)
    from comm_setup import build_optimizer
    w = torch.nn.Parameter(torch.zeros(2))
    opt = build_optimizer(ada, [w], None)
    assert opt.averager.outer is None and opt.param_groups[0]["lazy_correction"] == "rate"
    outer = _args("--hook", "local_sgd", "--optimizer", "local_adaalter", "--lazy-correction", "constant",
                  "--outer-lr", "0.7", "--outer-momentum", "0.9")
    opt = build_optimizer(outer, [w], None)
    assert (opt.averager.outer.lr, opt.averager.outer.momentum) == (0.7, 0.9)
    assert opt.param_groups[0]["lazy_correction"] == "constant"
    assert _args("--optimizer", "adagrad").eps == 1e-10
    assert _args("--amp", cuda=True).amp  # accepted where CUDA exists


@pytest.mark.parametrize("argv, in_sends", [
    (["--hook", "sparsify"], True),  # random_block with error feedback: SGD's momentum counted in sends
    (["--hook", "sparsify", "--method", "randomk", "--aggregation", "allgather"], True),
    (["--hook", "sparsify", "--method", "topk", "--aggregation", "allgather"], True),
    (["--hook", "sparsify", "--no-error-feedback"], False),
    (["--hook", "allreduce"], False),
])
def test_sparsify_keeps_sgds_momentum_and_weight_decay(argv, in_sends):
    import comm_setup

    args = _args(*argv, "--weight-decay", "5e-4")
    exchange = comm_setup.build_exchange(args)
    opt = comm_setup.build_optimizer(args, [torch.nn.Parameter(torch.zeros(2))], exchange)
    assert (opt.defaults["momentum"], opt.defaults["weight_decay"]) == (args.momentum, 5e-4)
    assert getattr(exchange.state, "momentum", 0.0) == 0.0
    assert getattr(exchange.state, "counts_momentum_in_sends", False) == in_sends


def test_amp_scaler_reaches_the_sparsifier():
    import comm_setup

    args = _args("--hook", "sparsify")
    scaler = torch.amp.GradScaler("cpu")
    assert comm_setup.build_exchange(args, grad_scaler=scaler).state.grad_scaler is scaler
    assert comm_setup.build_exchange(args).state.grad_scaler is None


def test_help_states_defaults():
    text = train_cifar.build_parser().format_help()
    for flag in ("--hook", "--density", "--period", "--epochs", "--lr-schedule", "--warmup-steps"):
        assert flag in text
    assert text.count("(default:") >= 30


def test_lr_factor_warmup_and_schedules():
    args = _args("--epochs", "4", "--lr-warmup-epochs", "1", "--lr-schedule", "cosine")
    assert train_cifar.lr_factor(0, 10, args) == pytest.approx(0.1)
    assert train_cifar.lr_factor(9, 10, args) == pytest.approx(1.0)
    assert train_cifar.lr_factor(10, 10, args) == pytest.approx(1.0)
    assert train_cifar.lr_factor(39, 10, args) < 0.01
    step = _args("--epochs", "4", "--lr-schedule", "step", "--lr-milestones", "1", "3")
    assert [train_cifar.lr_factor(s, 10, step) for s in (9, 10, 29, 30)] == pytest.approx([1, 0.1, 0.1, 0.01])
    assert train_cifar.lr_factor(25, 10, _args("--lr-schedule", "constant")) == 1.0


# ----- models -----
@pytest.mark.parametrize("name, params", [("resnet20", 269_722), ("resnet32", 464_154), ("resnet44", 658_586),
                                          ("resnet56", 853_018), ("resnet18", 11_173_962)])
def test_models_have_the_published_sizes(name, params):
    # He et al. 2016 table 6: 0.27M, 0.46M, 0.66M, 0.85M; ResNet-18 with a 10-class head: 11.17M
    model = cifar_models.build_model(name)
    assert sum(p.numel() for p in model.parameters()) == params
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 10)


def test_resnet18_has_a_cifar_stem():
    model = cifar_models.build_model("resnet18", width=8)
    assert model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1)
    assert isinstance(model.maxpool, torch.nn.Identity)
    assert model(torch.zeros(2, 3, 8, 8)).shape == (2, 10)


def test_unknown_model_is_refused():
    with pytest.raises(ValueError, match="choose one of resnet18"):
        cifar_models.build_model("vgg")


# ----- synthetic data -----
def test_synthetic_is_deterministic_and_leaves_global_rng_alone():
    before = torch.get_rng_state()
    a = cifar_data.make_synthetic(200, seed=3)
    b = cifar_data.make_synthetic(200, seed=3)
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)
    assert not torch.equal(a.images, cifar_data.make_synthetic(200, seed=4).images)
    assert not torch.equal(a.images, cifar_data.make_synthetic(200, seed=3, train=False).images)
    assert a.images.shape == (200, 3, 32, 32) and a.images.dtype == torch.uint8
    assert torch.bincount(a.labels, minlength=10).tolist() == [20] * 10


def _nearest_mean_accuracy(train, test, test_labels=None):
    x, xt = train.normalize(train.images).flatten(1), test.normalize(test.images).flatten(1)
    centroids = torch.stack([x[train.labels == k].mean(0) for k in range(10)])
    truth = test.labels if test_labels is None else test_labels
    return (torch.cdist(xt, centroids).argmin(1) == truth).float().mean().item()


def test_synthetic_is_learnable_because_images_depend_on_the_class():
    train = cifar_data.make_synthetic(1000, seed=0)
    test = cifar_data.make_synthetic(500, seed=0, train=False)
    assert _nearest_mean_accuracy(train, test) > 0.9
    # control: scored against shuffled test labels, the same classifier is at chance
    shuffled = test.labels[torch.randperm(500, generator=torch.Generator().manual_seed(0))]
    assert _nearest_mean_accuracy(train, test, shuffled) < 0.25


# ----- CIFAR-10 on disk -----
def test_cifar_folder_reader_keeps_layout_and_labels(tmp_path):
    written = write_cifar_folder(str(tmp_path), per_batch=4)
    train = cifar_data.read_cifar10_folder(str(tmp_path), train=True)
    test = cifar_data.read_cifar10_folder(str(tmp_path), train=False)
    assert train.images.shape == (20, 3, 32, 32) and test.images.shape == (4, 3, 32, 32)
    data, labels = written["data_batch_2"]
    # row-major 3x32x32: channel, then row, then column
    assert train.images[4, 1, 2, 5].item() == data[0, 1 * 1024 + 2 * 32 + 5]
    assert train.labels[4:8].tolist() == labels
    assert test.labels.tolist() == written["test_batch"][1]
    assert train.classes[0] == "airplane"


def test_cifar_through_torchvision_checks_md5_and_says_how_to_skip(tmp_path):
    write_cifar_folder(str(tmp_path), per_batch=4)
    with pytest.raises(RuntimeError, match="--cifar-skip-md5"):
        cifar_data.load_cifar10(str(tmp_path), train=True)
    assert len(cifar_data.load_cifar10(str(tmp_path), train=True, verify=False)) == 20


def test_own_reader_matches_torchvision_on_the_same_folder(tmp_path, monkeypatch):
    import torchvision.datasets.cifar as tv

    write_cifar_folder(str(tmp_path), per_batch=4)
    monkeypatch.setattr(tv, "check_integrity", lambda *a, **k: True)  # our files have other md5s
    monkeypatch.setattr(tv.CIFAR10, "_check_integrity", lambda self: True)
    for train in (True, False):
        ours = cifar_data.read_cifar10_folder(str(tmp_path), train)
        theirs = cifar_data.load_cifar10(str(tmp_path), train)
        assert torch.equal(ours.images, theirs.images) and torch.equal(ours.labels, theirs.labels)
        assert ours.classes == theirs.classes


def test_missing_cifar_folder_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="cifar-10-batches-py"):
        cifar_data.read_cifar10_folder(str(tmp_path), train=True)


# ----- augmentation -----
def test_augment_is_a_seeded_crop_or_flipped_crop_of_each_image():
    images = torch.randint(0, 256, (6, 3, 5, 5), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    out = cifar_data.augment(images, torch.Generator().manual_seed(7), padding=2)
    again = cifar_data.augment(images, torch.Generator().manual_seed(7), padding=2)
    assert torch.equal(out, again) and out.shape == images.shape
    padded = torch.nn.functional.pad(images, (2, 2, 2, 2))
    for i in range(6):
        crops = [padded[i, :, dy:dy + 5, dx:dx + 5] for dy in range(5) for dx in range(5)]
        assert any(torch.equal(out[i], c) or torch.equal(out[i], c.flip(2)) for c in crops), i
    assert not torch.equal(out, images)  # something moved


# ----- metrics -----
def _record(epoch, **kw):
    rec = dict(epoch=epoch, train_loss=1.0, test_loss=1.0, test_accuracy=0.5, images_per_s=100.0,
               bytes_sent_per_step=1500.0, bytes_sent=3000, bytes_dense=30000, time_forward_s=0.1,
               time_backward_exchange_s=0.2, time_hook_call_s=0.05, time_optimizer_s=0.01)
    rec.update(kw)
    return rec


def test_summary_table_and_metrics_file_resume(tmp_path):
    path = str(tmp_path / "m" / "metrics.jsonl")
    f = run_metrics.MetricsFile(path)
    for e in (1, 2, 3):
        f.write(_record(e))
    # resuming from epoch 2 drops epoch 3 (written after the checkpoint the run resumes from)
    resumed = run_metrics.MetricsFile(path, resume_epoch=2)
    assert [r["epoch"] for r in resumed.records] == [1, 2]
    assert [r["epoch"] for r in run_metrics.read_metrics(path)] == [1, 2]
    table = run_metrics.summary_table(resumed.records)
    assert "10.0x" in table and "1.5 kB" in table and "50.0%" in table
    assert len(table.splitlines()) == 4
    # a run killed while writing epoch 3's line: the torn line is dropped on resume, not a crash
    with open(path, "a") as out:
        out.write('{"epoch": 3, "train_lo')
    assert [r["epoch"] for r in run_metrics.MetricsFile(path, resume_epoch=2).records] == [1, 2]
    with open(path, "a") as out:
        out.write('{"epoch": 3, "train_lo\n' + '{"epoch": 4}\n')
    with pytest.raises(ValueError):  # a damaged line before the last is not a torn write: refused
        run_metrics.MetricsFile(path, resume_epoch=2)


def test_format_bytes():
    assert [run_metrics.format_bytes(n) for n in (12, 1500, 2.5e6, 7e9)] == ["12 B", "1.5 kB", "2.5 MB", "7.0 GB"]


# ----- plot -----
def test_plot_writes_a_figure(tmp_path):
    pytest.importorskip("matplotlib")
    import plot

    paths = []
    for hook, acc in (("allreduce", 0.6), ("sparsify", 0.5)):
        f = run_metrics.MetricsFile(str(tmp_path / hook / "metrics.jsonl"))
        for e in (1, 2):
            f.write(_record(e, test_accuracy=acc * e / 2, hook=hook, optimizer="sgd", step=10 * e,
                            bytes_sent_total=3000 * e, time_epoch_s=1.0))
        paths.append(f.path)
    out = plot.main(plot.parse_args(paths + ["-o", str(tmp_path / "c.png")]))
    assert os.path.getsize(out) > 1000


def test_plot_labels_tell_runs_of_one_hook_apart():
    import plot

    base = dict(optimizer="sgd", method=None, density=None, powersgd_rank=None, period=None)
    assert plot.label_of({**base, "hook": "sparsify", "method": "random_block", "density": 0.01}) == \
        "random_block d=0.01"
    assert plot.label_of({**base, "hook": "sparsify", "method": "topk", "density": 0.05}) == "topk d=0.05"
    assert plot.label_of({**base, "hook": "powersgd", "powersgd_rank": 4}) == "powersgd rank 4"
    assert plot.label_of({**base, "hook": "local_sgd", "optimizer": "local_adaalter", "period": 8}) == \
        "local_adaalter H=8"
    assert plot.label_of({"hook": "allreduce", "optimizer": "sgd"}) == "allreduce/sgd"  # records before the fields


def test_plot_refuses_mismatched_labels():
    import plot

    with pytest.raises(SystemExit):
        plot.parse_args(["a.jsonl", "b.jsonl", "--labels", "one"])


def test_block_size_and_density_warmup_reach_the_sparsifier():
    import comm_setup

    state = comm_setup.build_exchange(_args("--hook", "sparsify", "--block-size", "16",
                                            "--density-warmup-steps", "50")).state
    assert (state.block_size, state.density_warmup_steps) == (16, 50)
    default = comm_setup.build_exchange(_args("--hook", "sparsify")).state
    assert (default.block_size, default.density_warmup_steps) == (4, 1000)  # the hook's own defaults
    with pytest.raises(ValueError, match="--block-size must be >= 1, got 0"):
        _args("--hook", "sparsify", "--block-size", "0")
    with pytest.raises(ValueError, match="--density-warmup-steps applies to --hook sparsify only"):
        _args("--hook", "allreduce", "--density-warmup-steps", "5")

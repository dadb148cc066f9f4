"""2-process runs of recipes/train_cifar.py: every hook and optimizer, bytes counted, exact resume.

All combinations run inside one ``run_distributed`` launch (process start-up
is the expensive part): each rank calls the recipe's ``main`` several times in
the same gloo group, on a tiny model and tiny synthetic data. For each
combination it trains 2 epochs in one go, and 1 epoch + ``--resume`` + 1
epoch, and the tests compare the parameters bitwise. One more test starts the
real command line through torchrun.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch

from ddp_hooks.testing import free_port, run_distributed

from paths import RECIPES

sys.path.insert(0, RECIPES)

import train_cifar  # noqa: E402

TINY = ["--model", "resnet20", "--width", "4", "--image-size", "8", "--synthetic-size", "64",
        "--batch-size", "8", "--log-every", "100", "--threads", "1", "--lr", "0.05"]


def _has_local_sgd() -> bool:
    import ddp_hooks

    return all(hasattr(ddp_hooks, n) for n in ("LocalSGDState", "local_sgd_hook", "LocalAdaAlter"))


COMBOS = {
    "allreduce-sgd": ["--hook", "allreduce", "--optimizer", "sgd"],
    "fp16-sgd": ["--hook", "fp16", "--optimizer", "sgd", "--lr-schedule", "step"],
    "powersgd-adagrad": ["--hook", "powersgd", "--optimizer", "adagrad", "--powersgd-rank", "2",
                         "--warmup-steps", "2"],
    "sparsify-topk-allgather": ["--hook", "sparsify", "--method", "topk", "--aggregation", "allgather",
                                "--density", "0.1", "--scope", "bucket", "--density-warmup-steps", "0"],
    "sparsify-randomk-adagrad": ["--hook", "sparsify", "--method", "randomk", "--density", "0.1",
                                 "--optimizer", "adagrad", "--warmup-steps", "1", "--density-warmup-steps", "0"],
    "sparsify-block-global": ["--hook", "sparsify", "--method", "random_block", "--density", "0.1",
                              "--scope", "global", "--lr-warmup-epochs", "1", "--hook-seed", "3",
                              "--density-warmup-steps", "0", "--block-size", "4"],
    "sparsify-nodes": ["--hook", "sparsify", "--method", "shared_topk", "--density", "0.1", "--nodes", "2",
                       "--density-warmup-steps", "0"],
    "sparsify-no-ef": ["--hook", "sparsify", "--density", "0.2", "--no-error-feedback",
                       "--aggregation", "allgather", "--density-warmup-steps", "0"],
    "cifar-folder": ["--data", "cifar10", "--cifar-skip-md5", "--synthetic-size", "64"],
}
if _has_local_sgd():
    COMBOS["local_sgd-local_adaalter"] = ["--hook", "local_sgd", "--optimizer", "local_adaalter",
                                          "--period", "3", "--warmup-steps", "2", "--lr", "0.1",
                                          "--lazy-correction", "rate", "--outer-lr", "0.7", "--outer-momentum", "0.9"]
    COMBOS["local_adaalter-sparse-sync"] = ["--hook", "local_sgd", "--optimizer", "local_adaalter", "--period", "3",
                                            "--warmup-steps", "2", "--lr", "0.1", "--sync", "shared_topk",
                                            "--sync-density", "0.1", "--compress-accumulators"]


def write_cifar_folder(root: str, per_batch: int, seed: int = 0) -> dict:
    """Write a small CIFAR-10 in torchvision's on-disk format; return the arrays written."""
    rng = np.random.default_rng(seed)
    folder = os.path.join(root, "cifar-10-batches-py")
    os.makedirs(folder, exist_ok=True)
    written = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 256, size=(per_batch, 3072), dtype=np.uint8)
        labels = [int(x) for x in rng.integers(0, 10, size=per_batch)]
        entry = {"batch_label": name, "labels": labels, "data": data,
                 "filenames": [f"{name}_{i}.png" for i in range(per_batch)]}
        with open(os.path.join(folder, name), "wb") as f:
            pickle.dump(entry, f)
        written[name] = (data, labels)
    meta = {"num_cases_per_batch": per_batch, "num_vis": 3072,
            "label_names": ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship",
                            "truck"]}
    with open(os.path.join(folder, "batches.meta"), "wb") as f:
        pickle.dump(meta, f)
    return written


def _argv(name: str, base: str, cifar_dir: str):
    argv = TINY + COMBOS[name]
    if name == "cifar-folder":
        argv = [a for a in argv if a != "--image-size"]
        argv.remove("8")  # the image size: CIFAR-10 is 32x32
        argv = [a for a in argv if a not in ("--synthetic-size", "64")] + ["--data-dir", cifar_dir]
    return argv


def _all_combos(rank, world_size, base, cifar_dir, names):
    """On every rank: for each combination, 2 epochs straight and 1 + resume + 1."""
    out = {}
    for name in names:
        argv = _argv(name, base, cifar_dir)
        straight = train_cifar.main(train_cifar.parse_args(
            argv + ["--epochs", "2", "--out-dir", os.path.join(base, name, "straight")]))
        resumed_dir = os.path.join(base, name, "resumed")
        first = train_cifar.main(train_cifar.parse_args(argv + ["--epochs", "2", "--out-dir", resumed_dir,
                                                                "--stop-after", "1"]))
        second = train_cifar.main(train_cifar.parse_args(argv + ["--epochs", "2", "--out-dir", resumed_dir,
                                                                 "--resume"]))
        out[name] = {"straight": straight, "first": first, "second": second}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("recipes"))
    cifar_dir = os.path.join(base, "cifar")
    write_cifar_folder(cifar_dir, per_batch=16)
    results = run_distributed(_all_combos, 2, base, cifar_dir, list(COMBOS), timeout=300)
    return base, results


@pytest.mark.parametrize("name", list(COMBOS))
def test_resume_gives_bitwise_identical_parameters(runs, name):
    _, results = runs
    for rank in (0, 1):
        r = results[rank][name]
        assert [rec["epoch"] for rec in r["first"]["records"]] == [1]
        assert [rec["epoch"] for rec in r["second"]["records"]] == [2]
        assert torch.equal(r["straight"]["params"], r["second"]["params"]), f"rank {rank}: resume diverged"
        # the first epoch alone must have moved the parameters, else the equality proves little
        assert not torch.equal(r["first"]["params"], r["second"]["params"])
        straight_epoch2 = r["straight"]["records"][1]
        assert straight_epoch2["test_loss"] == r["second"]["records"][0]["test_loss"]
        assert straight_epoch2["bytes_sent_total"] == r["second"]["records"][0]["bytes_sent_total"]


@pytest.mark.parametrize("name", [n for n in COMBOS if not n.startswith("local_sgd")])
def test_synchronous_hooks_keep_replicas_identical(runs, name):
    _, results = runs
    assert torch.equal(results[0][name]["straight"]["params"], results[1][name]["straight"]["params"])


def test_metrics_file_has_one_line_per_epoch_after_resume(runs):
    base, _ = runs
    for name in COMBOS:
        with open(os.path.join(base, name, "resumed", "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f]
        assert [r["epoch"] for r in records] == [1, 2]
        for key in ("train_loss", "test_loss", "test_accuracy", "time_forward_s", "time_backward_exchange_s",
                    "time_hook_call_s", "time_optimizer_s", "bytes_sent", "bytes_dense"):
            assert isinstance(records[1][key], (int, float)), key
        assert os.path.exists(os.path.join(base, name, "resumed", "checkpoint-rank1.pt"))


def test_checkpoints_load_with_weights_only(runs):
    base, _ = runs
    for rank in (0, 1):
        snap = torch.load(os.path.join(base, "sparsify-topk-allgather", "straight", f"checkpoint-rank{rank}.pt"),
                          weights_only=True)
        assert snap["epoch"] == 2 and snap["step"] == 2 * 4
        assert snap["hook"]["state"]["rank"] == rank  # each rank saved its own residuals


def _resume_twice(rank, world_size, argv, out_dir):
    """Resume once; then, with rank 1's checkpoints gone, resume again: every rank must raise, none wait."""
    result = train_cifar.main(train_cifar.parse_args(argv))
    torch.distributed.barrier()
    if rank == 1:
        for suffix in ("", ".prev"):
            os.remove(os.path.join(out_dir, f"checkpoint-rank1{suffix}.pt"))
    torch.distributed.barrier()
    try:
        train_cifar.main(train_cifar.parse_args(argv))
    except ValueError as exc:
        return result, str(exc)
    return result, None


def test_resume_after_a_kill_between_two_ranks_saves(runs, tmp_path):
    """Rank 0 saved epoch 2, rank 1 died before it could: both resume from epoch 1, the last they share."""
    import shutil

    base, results = runs
    name = "sparsify-topk-allgather"
    out_dir = str(tmp_path / "killed")
    shutil.copytree(os.path.join(base, name, "straight"), out_dir)
    os.replace(os.path.join(out_dir, "checkpoint-rank1.prev.pt"), os.path.join(out_dir, "checkpoint-rank1.pt"))
    assert torch.load(os.path.join(out_dir, "checkpoint-rank0.pt"), weights_only=True)["epoch"] == 2
    argv = _argv(name, base, "") + ["--epochs", "2", "--out-dir", out_dir, "--resume"]
    resumed = run_distributed(_resume_twice, 2, argv, out_dir, timeout=120)
    for rank in (0, 1):
        result, error = resumed[rank]
        assert [rec["epoch"] for rec in result["records"]] == [2]
        assert torch.equal(result["params"], results[rank][name]["straight"]["params"])
        assert error is not None and "--resume: no epoch has a checkpoint on every rank" in error
        assert "(epochs per rank: [[2], []])" in error, error  # rank 0 keeps epoch 2 twice (latest, previous)


def _resume_error(rank, world_size, argv):
    try:
        train_cifar.main(train_cifar.parse_args(argv))
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.skipif(not _has_local_sgd(), reason="needs PyTorch's post_localSGD_hook")
def test_resume_with_another_lazy_correction_or_outer_optimizer_is_refused(runs, tmp_path):
    """A checkpoint's param groups would otherwise win over the flags, silently."""
    import shutil

    base, _ = runs
    name = "local_sgd-local_adaalter"
    for flag, value in (("--lazy-correction", "paper"), ("--outer-momentum", "0.5")):
        out_dir = str(tmp_path / flag)
        shutil.copytree(os.path.join(base, name, "straight"), out_dir)
        argv = _argv(name, base, "")
        argv[argv.index(flag) + 1] = value
        errors = run_distributed(_resume_error, 2, argv + ["--epochs", "3", "--out-dir", out_dir, "--resume"],
                                 timeout=120)
        key = flag[2:].replace("-", "_")
        assert all(e is not None and "written by another configuration" in e and f"'{key}'" in e for e in errors), \
            errors


def _epoch2(runs, name):
    return runs[1][0][name]["straight"]["records"][1]


def test_bytes_of_pytorch_hooks(runs):
    allreduce, fp16 = _epoch2(runs, "allreduce-sgd"), _epoch2(runs, "fp16-sgd")
    n_params = runs[1][0]["allreduce-sgd"]["straight"]["params"].numel()
    assert allreduce["bytes_sent_per_step"] == allreduce["bytes_dense"] / 4 == n_params * 4
    assert fp16["bytes_sent_per_step"] == n_params * 2
    powersgd = _epoch2(runs, "powersgd-adagrad")  # past its 2 dense steps: compressed throughout
    assert 0 < powersgd["bytes_sent"] < 0.7 * powersgd["bytes_dense"]


def test_bytes_of_sparsify(runs):
    for name in ("sparsify-topk-allgather", "sparsify-randomk-adagrad", "sparsify-block-global"):
        rec = _epoch2(runs, name)
        assert 0 < rec["bytes_sent"] < 0.5 * rec["bytes_dense"], name
    # the recipe reports the state's own counters
    stats = runs[1][0]["sparsify-block-global"]["straight"]["hook_stats"]
    assert stats["bytes_sent"] == _epoch2(runs, "sparsify-block-global")["bytes_sent_total"]


def test_metrics_name_what_tells_runs_apart_and_the_plot_labels_them_so(runs):
    import plot

    labels = {name: plot.label_of(_epoch2(runs, name)) for name in
              ("sparsify-topk-allgather", "sparsify-block-global", "powersgd-adagrad", "allreduce-sgd")}
    assert labels == {"sparsify-topk-allgather": "topk d=0.1", "sparsify-block-global": "random_block d=0.1",
                      "powersgd-adagrad": "powersgd rank 2", "allreduce-sgd": "allreduce/sgd"}
    if "local_sgd-local_adaalter" in COMBOS:
        assert plot.label_of(_epoch2(runs, "local_sgd-local_adaalter")) == "local_adaalter H=3"


def test_cli_through_torchrun(tmp_path):
    """The real command line: torchrun, 2 processes; accuracy rises above chance; a table is printed."""
    out_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
           os.path.join(RECIPES, "train_cifar.py"), "--data", "synthetic", "--hook", "allreduce",
           "--synthetic-noise", "2", "--model", "resnet20", "--width", "8", "--image-size", "16",
           "--synthetic-size", "1280", "--epochs", "2", "--batch-size", "32", "--out-dir", str(out_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    assert "summary (resnet20, hook allreduce" in log and "dense/sent" in log
    with open(out_dir / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert [r["epoch"] for r in records] == [1, 2]
    assert records[-1]["test_accuracy"] > 0.3  # chance is 0.1
    assert records[-1]["bytes_sent"] == records[-1]["bytes_dense"]


def test_invalid_flags_refused_in_one_line_by_rank_0_before_any_process_group(tmp_path):
    for bad in (["--hook", "sparsify", "--method", "topk"], ["--hook", "nonsense"]):
        lines = {}
        for rank in ("0", "1"):
            env = {k: v for k, v in os.environ.items() if k != "RANK"}
            if rank == "1":
                env["RANK"] = rank  # as torchrun sets it
            proc = subprocess.run([sys.executable, os.path.join(RECIPES, "train_cifar.py"), *bad],
                                  capture_output=True, text=True, timeout=60, env=env)
            assert proc.returncode == 2
            lines[rank] = proc.stderr.splitlines()
        assert lines["1"] == []  # the other ranks stay silent
        assert len(lines["0"]) == 1 and "usage:" not in lines["0"][0] and "--help" in lines["0"][0]
    assert "--hook: invalid choice: 'nonsense'" in lines["0"][0]
    proc = subprocess.run([sys.executable, os.path.join(RECIPES, "train_cifar.py"), "--hook", "sparsify",
                           "--method", "topk"], capture_output=True, text=True, timeout=60)
    assert "--method topk needs --aggregation allgather" in proc.stderr

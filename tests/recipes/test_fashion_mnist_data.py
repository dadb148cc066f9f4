"""recipes/fashion_mnist_data.py: the idx reader on tiny files in the real on-disk format, the folder search, the
recipe's flags, one short run of the recipe on such files, and the real Debian files where they are installed."""

from __future__ import annotations

import gzip
import json
import os
import struct
import subprocess
import sys

import pytest
import torch

from paths import RECIPES

sys.path.insert(0, RECIPES)

import fashion_mnist_data as fm  # noqa: E402
from fashion_folder import write_fashion_folder, write_idx  # noqa: E402
import train_cifar  # noqa: E402

IMAGES_MAGIC, LABELS_MAGIC = 0x00000803, 0x00000801


# ----- the idx reader -----
@pytest.mark.parametrize("gz", [(True,) * 4, (False,) * 4, (True, False, False, True)], ids=["gz", "plain", "mixed"])
def test_reader_round_trips_the_files(tmp_path, gz):
    written = write_fashion_folder(str(tmp_path), gz=gz)
    read = fm.read_fashion_mnist(str(tmp_path))
    for mine, theirs in zip(read, written):
        assert torch.equal(mine, theirs.to(mine.dtype))
    assert [t.dtype for t in read] == [torch.uint8, torch.int64] * 2
    assert read[0].shape == (12, 28, 28) and read[3].shape == (6,)


def test_plain_file_is_read_when_both_are_there(tmp_path):
    # torchvision's raw/ holds each file twice: the download (.gz) and its extraction
    write_fashion_folder(str(tmp_path), gz=(True,) * 4)
    plain = write_fashion_folder(str(tmp_path), seed=1, gz=(False,) * 4)
    assert torch.equal(fm.read_fashion_mnist(str(tmp_path))[0], plain[0])


def _damage(folder, name, data: bytes):
    path = os.path.join(folder, name + ".gz")
    with gzip.open(path, "wb") as f:
        f.write(data)
    return path


@pytest.mark.parametrize("case, match", [
    ("labels-as-images", r"magic number 0x00000801, expected 0x00000803 .*not a Fashion-MNIST image file"),
    ("truncated", r"7000 bytes, expected 9424 \(a 16-byte header.*sizes \(12, 28, 28\)\).*truncated"),
    ("trailing", r"9425 bytes, expected 9424"),
    ("short-header", r"10 bytes, fewer than the 16 of an idx header"),
    ("not-gzip", r"cannot be read as a gzip file"),
    ("27x27", r"images of 27x27 pixels, expected 28x28"),
])
def test_bad_image_files_are_named_with_the_rule(tmp_path, case, match):
    folder = str(tmp_path)
    write_fashion_folder(folder)
    name = "train-images-idx3-ubyte"
    path = os.path.join(folder, name + ".gz")
    with gzip.open(path, "rb") as f:
        good = f.read()
    labels = struct.pack(">II", LABELS_MAGIC, 12) + bytes(12)
    if case == "not-gzip":
        with open(path, "wb") as f:
            f.write(b"plain bytes, no gzip header")
    elif case == "27x27":
        write_idx(path, torch.zeros(12, 27, 27, dtype=torch.uint8))
    else:
        _damage(folder, name, {"labels-as-images": labels, "truncated": good[:7000], "trailing": good + b"x",
                               "short-header": good[:10]}[case])
    with pytest.raises(ValueError, match=match) as info:
        fm.read_fashion_mnist(folder)
    assert path in str(info.value)


@pytest.mark.parametrize("case, match", [
    ("count", r"t10k-labels-idx1-ubyte.gz: 5 labels, expected 6, one per image of .*t10k-images-idx3-ubyte.gz"),
    ("range", r"t10k-labels-idx1-ubyte.gz: label 10, expected 0..9: Fashion-MNIST has 10 classes"),
    ("magic", r"t10k-labels-idx1-ubyte.gz: magic number 0x00000803, expected 0x00000801 .*label file"),
])
def test_bad_label_files_are_named_with_the_rule(tmp_path, case, match):
    write_fashion_folder(str(tmp_path))
    path = os.path.join(str(tmp_path), "t10k-labels-idx1-ubyte.gz")
    labels = {"count": torch.zeros(5, dtype=torch.uint8), "range": torch.full((6,), 10, dtype=torch.uint8),
              "magic": torch.zeros(6, 28, 28, dtype=torch.uint8)}[case]
    write_idx(path, labels, magic=LABELS_MAGIC if case != "magic" else None)
    with pytest.raises(ValueError, match=match):
        fm.read_fashion_mnist(str(tmp_path))


def test_missing_file_is_named(tmp_path):
    write_fashion_folder(str(tmp_path))
    os.remove(os.path.join(str(tmp_path), "t10k-images-idx3-ubyte.gz"))
    with pytest.raises(FileNotFoundError, match=r"no t10k-images-idx3-ubyte \(plain or .gz\)"):
        fm.read_fashion_mnist(str(tmp_path))


# ----- finding and loading a folder -----
@pytest.mark.parametrize("layout", ["debian", "torchvision"])
def test_load_finds_both_layouts(tmp_path, layout):
    data_dir = str(tmp_path)
    folder = data_dir if layout == "debian" else os.path.join(data_dir, "FashionMNIST", "raw")
    written = write_fashion_folder(folder, gz=(True,) * 4 if layout == "debian" else (False,) * 4)
    assert fm.find_fashion_mnist(data_dir) == folder
    train, test = fm.load_fashion_mnist(data_dir)
    assert train.images.shape == (12, 3, 28, 28) and test.images.shape == (6, 3, 28, 28)
    for c in range(3):  # three equal channels, each the file's image
        assert torch.equal(train.images[:, c], written[0])
    assert torch.equal(test.labels, written[3].long())
    assert train.classes[0] == "T-shirt/top" and len(train.classes) == 10
    normalized = train.normalize(train.images[:2])
    assert normalized.shape == (2, 3, 28, 28)
    assert normalized[0, 0, 0, 0].item() == pytest.approx((written[0][0, 0, 0].item() / 255 - 0.2860) / 0.3530)


def test_default_is_the_debian_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(fm, "DEBIAN_FOLDER", str(tmp_path))
    write_fashion_folder(str(tmp_path))
    assert len(fm.load_fashion_mnist()[0]) == 12


def test_missing_data_says_what_and_how_and_never_falls_back(tmp_path, monkeypatch):
    debian = str(tmp_path / "debian")
    write_fashion_folder(debian)  # present, but a given --data-dir is the only folder searched
    monkeypatch.setattr(fm, "DEBIAN_FOLDER", debian)
    empty = str(tmp_path / "empty")
    os.makedirs(empty)
    write_idx(os.path.join(empty, "train-labels-idx1-ubyte"), torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(FileNotFoundError) as info:
        fm.load_fashion_mnist(empty)
    text = str(info.value)
    for part in (f"{empty!r}", "lacks train-images-idx3-ubyte, t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte",
                 os.path.join(empty, "FashionMNIST", "raw") + ": no such folder",
                 "apt-get install dataset-fashion-mnist", "--download with --data-dir"):
        assert part in text, part
    monkeypatch.setattr(fm, "DEBIAN_FOLDER", str(tmp_path / "absent"))
    with pytest.raises(FileNotFoundError, match="no data_dir .*given: searched the Debian folder.*no such folder"):
        fm.load_fashion_mnist()


def test_download_goes_through_torchvision_only_when_missing(tmp_path, monkeypatch):
    import torchvision.datasets

    calls = []

    class FakeFashionMNIST:  # stands in for the download: writes torchvision's layout
        def __init__(self, root, download=False):
            calls.append((root, download))
            write_fashion_folder(os.path.join(root, "FashionMNIST", "raw"))

    monkeypatch.setattr(torchvision.datasets, "FashionMNIST", FakeFashionMNIST)
    train, _ = fm.load_fashion_mnist(str(tmp_path), download=True)
    assert calls == [(str(tmp_path), True)] and len(train) == 12
    fm.load_fashion_mnist(str(tmp_path), download=True)
    assert len(calls) == 1  # there already: no second download
    with pytest.raises(ValueError, match="download=True needs data_dir"):
        fm.load_fashion_mnist(download=True)

    class Offline:
        def __init__(self, root, download=False):
            raise RuntimeError("<urlopen error no network>")

    monkeypatch.setattr(torchvision.datasets, "FashionMNIST", Offline)
    with pytest.raises(RuntimeError, match="could not download .*no network.*apt-get install dataset-fashion-mnist"):
        fm.load_fashion_mnist(str(tmp_path / "other"), download=True)


# ----- the recipe -----
def _args(*argv):
    args = train_cifar.build_parser().parse_args(list(argv))
    train_cifar.validate_args(args, cuda_available=False)
    return args


@pytest.mark.parametrize("argv, match", [
    (["--download"], "--data fashion-mnist --download needs --data-dir"),
    (["--data-dir", "x", "--cifar-skip-md5"], "--cifar-skip-md5 applies to --data cifar10 only"),
    (["--image-size", "16"], "Fashion-MNIST images are 28x28"),
])
def test_fashion_flags_are_checked(argv, match):
    with pytest.raises(ValueError, match=match):
        _args("--data", "fashion-mnist", *argv)


def test_fashion_flags_and_defaults():
    args = _args("--data", "fashion-mnist")
    assert args.data_dir is None and args.augment == "auto"
    assert _args("--data", "fashion-mnist", "--data-dir", "x", "--download").download
    text = train_cifar.build_parser().format_help()
    assert "fashion-mnist" in text and fm.DEBIAN_FOLDER in text


def test_recipe_loads_the_given_folder_and_refuses_a_wrong_one(tmp_path):
    write_fashion_folder(str(tmp_path / "d"))
    train, test = train_cifar._load_data(_args("--data", "fashion-mnist", "--data-dir", str(tmp_path / "d")), 0)
    assert (len(train), len(test)) == (12, 6)
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist"):
        train_cifar._load_data(_args("--data", "fashion-mnist", "--data-dir", str(tmp_path)), 0)


def test_recipe_runs_one_epoch_on_tiny_files(tmp_path):
    """The command line as one process (no torchrun): trains, evaluates and writes metrics."""
    write_fashion_folder(str(tmp_path / "data"), n_train=64, n_test=20)
    out_dir = tmp_path / "run"
    cmd = [sys.executable, os.path.join(RECIPES, "train_cifar.py"), "--data", "fashion-mnist",
           "--data-dir", str(tmp_path / "data"), "--model", "resnet20", "--width", "4", "--epochs", "1",
           "--batch-size", "16", "--threads", "1", "--log-every", "100", "--out-dir", str(out_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resnet20 on fashion-mnist (64 train / 20 test images)" in proc.stderr
    with open(out_dir / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert [r["epoch"] for r in records] == [1] and records[0]["step"] == 4
    assert 0.0 <= records[0]["test_accuracy"] <= 1.0 and records[0]["train_loss"] > 0


# ----- the real files -----
@pytest.mark.skipif(not os.path.isdir(fm.DEBIAN_FOLDER),
                    reason=f"{fm.DEBIAN_FOLDER} absent: apt-get install dataset-fashion-mnist")
def test_real_debian_files_load_with_the_published_counts_and_statistics():
    train, test = fm.load_fashion_mnist()
    assert train.images.shape == (60000, 3, 28, 28) and test.images.shape == (10000, 3, 28, 28)
    assert torch.bincount(train.labels).tolist() == [6000] * 10
    assert torch.bincount(test.labels).tolist() == [1000] * 10
    assert test.labels[:5].tolist() == [9, 2, 1, 1, 6]  # ankle boot, pullover, trouser, trouser, shirt
    pixels = train.images[:, 0].to(torch.float64) / 255
    assert pixels.mean().item() == pytest.approx(fm.FASHION_MNIST_MEAN[0], abs=5e-5)
    assert pixels.std().item() == pytest.approx(fm.FASHION_MNIST_STD[0], abs=5e-5)

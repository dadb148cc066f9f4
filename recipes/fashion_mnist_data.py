"""Fashion-MNIST for the CIFAR recipe, read from its idx files without torchvision.

Fashion-MNIST (Xiao, Rasul and Vollgraf, 2017): 60 000 training and 10 000
test greyscale 28x28 images of clothing in 10 classes, as four idx files,
gzip'd or plain, which :func:`read_fashion_mnist` parses. :func:`load_fashion_mnist`
finds them in ``data_dir`` (directly, or in torchvision's ``FashionMNIST/raw/``)
or else where Debian's ``dataset-fashion-mnist`` installs them::

    >>> import os
    >>> if os.path.isdir(DEBIAN_FOLDER):  # apt-get install dataset-fashion-mnist
    ...     train, test = load_fashion_mnist()
    ...     assert train.images.shape == (60000, 3, 28, 28) and len(test) == 10000

Each image is replicated to 3 equal channels (a view, no copy), so
:class:`cifar_data.ImageSet`, :func:`cifar_data.augment` and the models'
3-channel stem take it unchanged: with equal channels and equal normalisation
the first convolution acts as a 1-channel one whose kernel is the sum of its
three, so nothing is lost but that one layer's extra input reads. The models
pool adaptively, so 28x28 needs no resize. ``--augment auto`` gives it the
CIFAR crop-flip: the zero padding is the black background, and a garment
shifted a few pixels or mirrored left to right keeps its class.
"""

from __future__ import annotations

import gzip
import os
import struct
from typing import List, Optional, Tuple

import torch

from cifar_data import ImageSet

__all__ = ["DEBIAN_FOLDER", "TORCHVISION_SUBFOLDER", "FASHION_MNIST_CLASSES", "FASHION_MNIST_MEAN",
           "FASHION_MNIST_STD", "read_fashion_mnist", "find_fashion_mnist", "load_fashion_mnist"]

DEBIAN_FOLDER = "/usr/share/datasets/fashion-mnist"
TORCHVISION_SUBFOLDER = os.path.join("FashionMNIST", "raw")  # where torchvision.datasets.FashionMNIST puts them
FASHION_MNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker",
                         "Bag", "Ankle boot")
# Mean and std of the 60 000 training images' pixels, 0..1 scale (0.28604, 0.35302; the tests recompute them).
FASHION_MNIST_MEAN = (0.2860,) * 3
FASHION_MNIST_STD = (0.3530,) * 3
# (train images, train labels, test images, test labels), without ".gz"
FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
_IMAGES_MAGIC, _LABELS_MAGIC = 0x00000803, 0x00000801  # unsigned bytes, 3 dimensions / 1 dimension


def _file(folder: str, name: str) -> Optional[str]:
    """The plain file if there is one (no decompression), else the ``.gz``, else None."""
    for path in (os.path.join(folder, name), os.path.join(folder, name + ".gz")):
        if os.path.isfile(path):
            return path
    return None


def _read_idx(path: str, magic: int) -> torch.Tensor:
    """One idx file (gzip'd if its name ends in ``.gz``) as a ``uint8`` tensor of the sizes in its header."""
    try:
        with (gzip.open if path.endswith(".gz") else open)(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError) as exc:  # gzip.BadGzipFile is an OSError; a truncated .gz raises EOFError
        how = "a gzip file (its name ends in .gz)" if path.endswith(".gz") else "a file"
        raise ValueError(f"{path}: cannot be read as {how}: {exc}") from exc
    ndim, header = magic & 0xFF, 4 + 4 * (magic & 0xFF)
    kind = f"Fashion-MNIST {'image' if ndim == 3 else 'label'} file"
    if len(data) < header:
        raise ValueError(f"{path}: {len(data)} bytes, fewer than the {header} of an idx header (magic number and "
                         f"{ndim} sizes): not a {kind}, or a truncated one")
    if struct.unpack(">I", data[:4])[0] != magic:
        raise ValueError(f"{path}: magic number 0x{struct.unpack('>I', data[:4])[0]:08x}, expected 0x{magic:08x} "
                         f"(idx, unsigned bytes, {ndim} dimension{'s' if ndim > 1 else ''}): not a {kind}")
    sizes = struct.unpack(f">{ndim}I", data[4:header])
    expected = header + torch.Size(sizes).numel()
    if len(data) != expected:
        raise ValueError(f"{path}: {len(data)} bytes, expected {expected} (a {header}-byte header, then one byte "
                         f"for each entry of its sizes {sizes}): the {kind} is truncated or has trailing data")
    payload = bytearray(memoryview(data)[header:])  # torch.frombuffer refuses an empty buffer
    return (torch.frombuffer(payload, dtype=torch.uint8) if payload else torch.empty(0, dtype=torch.uint8)).view(sizes)


def read_fashion_mnist(folder: str) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Read the four idx files in ``folder``, each gzip'd or plain (the plain one when both are there).

    Returns ``(train_images, train_labels, test_images, test_labels)``:
    images ``uint8`` of shape ``(N, 28, 28)``, labels ``int64`` of shape
    ``(N,)`` in 0..9. Raises ``FileNotFoundError`` naming the missing files,
    and ``ValueError`` naming the file and the rule it breaks (magic number,
    byte count, image size, label count or range).
    """
    paths = [_file(folder, name) for name in FILES]
    missing = [name for name, path in zip(FILES, paths) if path is None]
    if missing:
        raise FileNotFoundError(f"{folder}: no {', '.join(missing)} (plain or .gz): the four Fashion-MNIST idx "
                                f"files are {', '.join(FILES)}")
    out = []
    for images_path, labels_path in (paths[:2], paths[2:]):
        images = _read_idx(images_path, _IMAGES_MAGIC)
        labels = _read_idx(labels_path, _LABELS_MAGIC).to(torch.int64)
        if images.shape[1:] != (28, 28):
            raise ValueError(f"{images_path}: images of {images.shape[1]}x{images.shape[2]} pixels, expected "
                             f"28x28: Fashion-MNIST images are 28x28")
        if len(labels) != len(images):
            raise ValueError(f"{labels_path}: {len(labels)} labels, expected {len(images)}, one per image of "
                             f"{images_path}")
        if len(labels) and labels.max() >= len(FASHION_MNIST_CLASSES):
            raise ValueError(f"{labels_path}: label {labels.max().item()}, expected 0..9: Fashion-MNIST has "
                             f"10 classes")
        out += [images, labels]
    return tuple(out)


def find_fashion_mnist(data_dir: Optional[str] = None) -> str:
    """The folder holding the four files: ``data_dir`` itself, else ``data_dir/FashionMNIST/raw``; the Debian
    folder when ``data_dir`` is None. Raises ``FileNotFoundError`` saying what is missing and how to get it."""
    candidates = [DEBIAN_FOLDER] if data_dir is None else [data_dir, os.path.join(data_dir, TORCHVISION_SUBFOLDER)]
    problems: List[str] = []
    for folder in candidates:
        missing = [name for name in FILES if _file(folder, name) is None]
        if not missing:
            return folder
        problems.append(f"{folder}: " + ("no such folder" if not os.path.isdir(folder) else
                                         f"lacks {', '.join(missing)} (plain or .gz)"))
    where = "no data_dir (--data-dir) given: searched the Debian folder" if data_dir is None else \
        f"data_dir (--data-dir) {data_dir!r}: searched the folder itself and {TORCHVISION_SUBFOLDER}/ under it"
    raise FileNotFoundError(
        f"Fashion-MNIST not found ({where}): {'; '.join(problems)}. Get it with `apt-get install "
        f"dataset-fashion-mnist` (installs {DEBIAN_FOLDER}), or where there is internet pass --download with "
        f"--data-dir DIR (torchvision downloads into DIR/{TORCHVISION_SUBFOLDER})")


def load_fashion_mnist(data_dir: Optional[str] = None, download: bool = False) -> Tuple[ImageSet, ImageSet]:
    """Fashion-MNIST's training and test :class:`ImageSet`, images ``uint8`` ``(N, 3, 28, 28)``.

    Args:
        data_dir (str, optional): folder with the four idx files, directly
            (Debian's layout) or in ``FashionMNIST/raw/`` (torchvision's).
            Default: :data:`DEBIAN_FOLDER`; a given folder is the only one
            searched, with no fall-back to other data.
        download (bool): if the files are not in ``data_dir``, download them
            with ``torchvision.datasets.FashionMNIST(data_dir, download=True)``
            (needs ``data_dir`` and internet).
    """
    if download:
        if data_dir is None:
            raise ValueError("download=True needs data_dir, the folder that receives FashionMNIST/raw/; the "
                             f"Debian folder {DEBIAN_FOLDER} comes from apt-get, not from a download")
        try:
            find_fashion_mnist(data_dir)
        except FileNotFoundError:
            from torchvision.datasets import FashionMNIST

            try:
                FashionMNIST(data_dir, download=True)
            except Exception as exc:  # URLError, RuntimeError, ...: say where it went and what else works
                raise RuntimeError(f"torchvision could not download Fashion-MNIST into {data_dir!r} ({exc}); "
                                   f"without internet, `apt-get install dataset-fashion-mnist`") from exc
    train_images, train_labels, test_images, test_labels = read_fashion_mnist(find_fashion_mnist(data_dir))
    return tuple(ImageSet(images[:, None].expand(-1, 3, -1, -1), labels, FASHION_MNIST_MEAN, FASHION_MNIST_STD,
                          FASHION_MNIST_CLASSES)
                 for images, labels in ((train_images, train_labels), (test_images, test_labels)))

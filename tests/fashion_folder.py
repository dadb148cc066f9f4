"""Tiny Fashion-MNIST folders in the real on-disk format (idx files, plain or gzip'd), for tests of the readers."""

from __future__ import annotations

import gzip
import os
import struct
import sys

import torch

from paths import RECIPES

sys.path.insert(0, RECIPES)

import fashion_mnist_data as fm  # noqa: E402

__all__ = ["write_idx", "write_fashion_folder"]


def write_idx(path: str, array: torch.Tensor, magic: int = None) -> None:
    """``array`` (uint8) as an idx file: big-endian magic, one big-endian int32 per size, the bytes row-major."""
    magic = 0x00000800 + array.dim() if magic is None else magic
    data = struct.pack(">I", magic) + struct.pack(f">{array.dim()}I", *array.shape) + array.numpy().tobytes()
    with (gzip.open if path.endswith(".gz") else open)(path, "wb") as f:
        f.write(data)


def write_fashion_folder(folder: str, n_train: int = 12, n_test: int = 6, seed: int = 0, gz=(True,) * 4) -> tuple:
    """The four files in ``folder``, file ``i`` gzip'd if ``gz[i]``; return the arrays written (reader's order)."""
    gen = torch.Generator().manual_seed(seed)
    arrays = []
    for n in (n_train, n_test):
        labels = torch.arange(n, dtype=torch.uint8) % 10
        # class-dependent images: a bright bar at a row set by the label, over noise
        images = torch.randint(0, 100, (n, 28, 28), dtype=torch.uint8, generator=gen)
        for i, k in enumerate(labels.tolist()):
            images[i, 2 + 2 * k:4 + 2 * k] = 250
        arrays += [images, labels]
    os.makedirs(folder, exist_ok=True)
    for name, array, zipped in zip(fm.FILES, arrays, gz):
        write_idx(os.path.join(folder, name + (".gz" if zipped else "")), array)
    return tuple(arrays)

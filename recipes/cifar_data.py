"""Image data for the CIFAR recipe: CIFAR-10 (torchvision or its on-disk format) and a synthetic look-alike.

Every data set is held in memory as an :class:`ImageSet`: ``uint8`` images
of shape ``(N, 3, H, W)`` and ``int64`` labels. Batches are cut from it by
index (the indices come from a ``DistributedSampler``), then augmented and
normalised on the training device by :func:`augment` and
:meth:`ImageSet.normalize`, so no DataLoader worker is needed and the
augmentation is a pure function of a seed: a resumed run draws exactly the
crops and flips the uninterrupted run would have drawn.

Three sources:

* :func:`load_cifar10` with ``verify=True`` goes through
  ``torchvision.datasets.CIFAR10``, which downloads on request and checks
  the md5 of every file: the path for real users.
* :func:`load_cifar10` with ``verify=False`` reads the same on-disk format
  (``cifar-10-batches-py/`` with ``data_batch_1..5``, ``test_batch`` and
  ``batches.meta`` pickles) with :func:`read_cifar10_folder`, without the
  md5 check, for a local copy or a subset written in that format.
* :func:`make_synthetic`: class templates plus noise, deterministic from a
  seed, learnable, and needing nothing from outside.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from typing import Tuple

import torch
import torch.nn.functional as F

__all__ = [
    "ImageSet",
    "CIFAR10_FOLDER",
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "load_cifar10",
    "read_cifar10_folder",
    "make_synthetic",
    "augment",
]

CIFAR10_FOLDER = "cifar-10-batches-py"
# Per-channel mean and standard deviation of the CIFAR-10 training images, on a 0..1 scale.
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
_TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
_TEST_FILES = ("test_batch",)


@dataclass
class ImageSet:
    """Images (``uint8``, ``(N, 3, H, W)``), labels (``int64``, ``(N,)``) and the normalisation to apply."""

    images: torch.Tensor
    labels: torch.Tensor
    mean: Tuple[float, float, float]
    std: Tuple[float, float, float]
    classes: Tuple[str, ...]

    def __post_init__(self):
        if self.images.dtype != torch.uint8 or self.images.dim() != 4 or self.images.shape[1] != 3:
            raise ValueError(f"images must be uint8 of shape (N, 3, H, W), got {self.images.dtype} "
                             f"{tuple(self.images.shape)}")
        if self.labels.shape != (self.images.shape[0],):
            raise ValueError(f"{self.images.shape[0]} images but labels of shape {tuple(self.labels.shape)}")
        self.labels = self.labels.to(torch.int64)

    def __len__(self) -> int:
        return self.images.shape[0]

    def normalize(self, images: torch.Tensor) -> torch.Tensor:
        """``uint8`` images (any device) -> float32, scaled to 0..1 and standardised per channel."""
        mean = torch.tensor(self.mean, device=images.device).view(1, 3, 1, 1)
        std = torch.tensor(self.std, device=images.device).view(1, 3, 1, 1)
        return (images.float() / 255.0 - mean) / std


def read_cifar10_folder(root: str, train: bool) -> ImageSet:
    """Read CIFAR-10 from torchvision's on-disk format, without checking md5s.

    Args:
        root (str): the folder that holds ``cifar-10-batches-py/``.
        train (bool): the five training batches, else ``test_batch``.
    """
    folder = os.path.join(root, CIFAR10_FOLDER)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"no CIFAR-10 folder {folder!r}: expected {CIFAR10_FOLDER}/ under --data-dir")
    images, labels = [], []
    for name in _TRAIN_FILES if train else _TEST_FILES:
        path = os.path.join(folder, name)
        with open(path, "rb") as f:
            entry = pickle.load(f, encoding="latin1")
        data = torch.as_tensor(entry["data"], dtype=torch.uint8)
        if data.dim() != 2 or data.shape[1] != 3 * 32 * 32:
            raise ValueError(f"{path}: 'data' must have shape (N, 3072), got {tuple(data.shape)}")
        images.append(data.view(-1, 3, 32, 32))
        labels.extend(entry["labels"])
    with open(os.path.join(folder, "batches.meta"), "rb") as f:
        classes = tuple(pickle.load(f, encoding="latin1")["label_names"])
    return ImageSet(torch.cat(images), torch.tensor(labels), CIFAR10_MEAN, CIFAR10_STD, classes)


def load_cifar10(root: str, train: bool, download: bool = False, verify: bool = True) -> ImageSet:
    """Load CIFAR-10 into memory.

    Args:
        root (str): the folder that holds (or receives) ``cifar-10-batches-py/``.
        train (bool): training split (50 000 images), else the test split (10 000).
        download (bool): let torchvision download it first (needs ``verify``).
        verify (bool): load through ``torchvision.datasets.CIFAR10``, which
            checks every file's md5; ``False`` reads the folder directly with
            :func:`read_cifar10_folder` (for a local copy or subset).
    """
    if not verify:
        if download:
            raise ValueError("download=True needs verify=True: downloads go through torchvision")
        return read_cifar10_folder(root, train)
    from torchvision.datasets import CIFAR10

    try:
        ds = CIFAR10(root, train=train, download=download)
    except RuntimeError as exc:
        raise RuntimeError(
            f"torchvision could not load CIFAR-10 from {root!r} ({exc}). Pass --download to fetch it, "
            f"or --cifar-skip-md5 to read a local folder in the same format without checking md5s"
        ) from exc
    images = torch.as_tensor(ds.data).permute(0, 3, 1, 2).contiguous()  # NHWC -> NCHW
    return ImageSet(images, torch.tensor(ds.targets), CIFAR10_MEAN, CIFAR10_STD, tuple(ds.classes))


def _class_templates(seed: int, num_classes: int, size: int) -> torch.Tensor:
    """One smooth random image per class: 4x4 Gaussian noise upsampled to ``size``."""
    gen = torch.Generator().manual_seed(seed)
    coarse = torch.randn(num_classes, 3, 4, 4, generator=gen)
    return F.interpolate(coarse, size=(size, size), mode="bilinear", align_corners=False)


def make_synthetic(num_images: int, seed: int, train: bool = True, image_size: int = 32,
                   num_classes: int = 10, noise: float = 1.5) -> ImageSet:
    """A learnable stand-in for CIFAR-10: per-class smooth template plus pixel noise.

    The templates depend only on ``seed``, so the training and test splits
    share them; the labels and the noise come from a generator seeded with
    ``(seed, split)``. The same arguments give the same images bit for bit,
    and the global RNG is not touched.

    Args:
        num_images (int): number of images.
        seed (int): data seed.
        train (bool): which split (they differ in labels and noise).
        image_size (int): height and width (32 like CIFAR; smaller for tests).
        num_classes (int): number of classes (balanced up to one image).
        noise (float): standard deviation of the noise, in template units.
    """
    if num_images < 1:
        raise ValueError(f"num_images must be >= 1, got {num_images}")
    templates = _class_templates(seed, num_classes, image_size)
    gen = torch.Generator().manual_seed(seed * 2 + (1 if train else 2))
    labels = torch.arange(num_images) % num_classes
    labels = labels[torch.randperm(num_images, generator=gen)]
    values = templates[labels] + noise * torch.randn(num_images, 3, image_size, image_size, generator=gen)
    # Stored like real images: uint8 around mid-grey.
    images = (128 + 32 * values).round().clamp(0, 255).to(torch.uint8)
    mean, std = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)
    return ImageSet(images, labels, mean, std, tuple(f"class{i}" for i in range(num_classes)))


def augment(images: torch.Tensor, generator: torch.Generator, padding: int = 4) -> torch.Tensor:
    """Random crop (zero padding of ``padding`` pixels) and random horizontal flip, per image.

    Works on a batch of ``(B, C, H, W)`` on any device; the offsets and flips
    are drawn on the CPU from ``generator``, so they do not depend on the device.
    """
    b, _, h, w = images.shape
    dy = torch.randint(0, 2 * padding + 1, (b,), generator=generator)
    dx = torch.randint(0, 2 * padding + 1, (b,), generator=generator)
    flip = torch.rand(b, generator=generator) < 0.5
    padded = F.pad(images, (padding, padding, padding, padding))
    rows = (dy[:, None] + torch.arange(h)).to(images.device)  # (B, H)
    cols = (dx[:, None] + torch.arange(w)).to(images.device)  # (B, W)
    cols = torch.where(flip.to(images.device)[:, None], cols.flip(1), cols)
    batch = torch.arange(b, device=images.device)[:, None, None]
    out = padded.permute(0, 2, 3, 1)[batch, rows[:, :, None], cols[:, None, :]]  # (B, H, W, C)
    return out.permute(0, 3, 1, 2).contiguous()

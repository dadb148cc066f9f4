"""The benchmarks' models by name: the CIFAR recipe's family, a Fashion-MNIST CNN and a character LSTM.

``fmnist-cnn`` is the time-to-accuracy benchmark's model: light on compute
(about 5.4 M multiply-adds per 28x28 image forward) and heavy on parameters
(1,227,786 in 6 tensors, 4.9 MB of fp32 gradient per step), so that on the
simulated cluster's shared cores the exchange, not the arithmetic, decides the
step time at 1 Gbit/s and below. Layers: convolution 1-32 of 5x5 and 32-64 of
3x3 (each with ReLU and 2x2 max-pooling), then linear 3136-384, ReLU, and
linear 384-10; no batch norm, so nothing but the exchange couples the ranks.

    >>> model = build_bench_model("fmnist-cnn")
    >>> images, labels = synthetic_batch("fmnist-cnn", rank=0, batch=2, image_size=32)
    >>> tuple(model(images).shape), sum(p.numel() for p in model.parameters())
    ((2, 10), 1227786)

``fmnist-resnet20`` is its second model, with the opposite shape: ResNet-20
(He et al. 2016, the CIFAR variant) at width 32 on greyscale input, 1,073,386
parameters spread over 19 convolutions of 3x3 (the largest holds 14 % of
them), each followed by batch norm; about 30 times fmnist-cnn's compute.

    >>> model = build_bench_model("fmnist-resnet20")
    >>> images, labels = synthetic_batch("fmnist-resnet20", rank=0, batch=2, image_size=32)
    >>> tuple(model(images).shape), sum(p.numel() for p in model.parameters())
    ((2, 10), 1073386)

``fortunes-lstm`` is the Local AdaAlter benchmark's language model on Debian's
``fortunes`` files: embedding 64, one LSTM layer of 128, a linear head over
the :data:`FORTUNES_VOCAB` characters; 120,944 parameters. Its batches are
windows of 64 characters; its output holds the logits of each position.

    >>> tokens, nexts = synthetic_batch("fortunes-lstm", rank=0, batch=2, image_size=32)
    >>> tuple(build_bench_model("fortunes-lstm")(tokens).shape), tuple(nexts.shape)
    ((2, 64, 112), (2, 64))
"""

from __future__ import annotations

import os
import sys
from typing import Optional, Tuple

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes"))

from cifar_models import MODELS as CIFAR_MODELS, build_model  # noqa: E402

__all__ = ["MODELS", "FASHION_MNIST_MODELS", "FORTUNES_VOCAB", "CharLSTM", "build_bench_model", "synthetic_batch",
           "fmnist_cnn", "fmnist_resnet20"]

#: the models that take Fashion-MNIST's 1x28x28 images
FASHION_MNIST_MODELS = ("fmnist-cnn", "fmnist-resnet20")
MODELS = CIFAR_MODELS + FASHION_MNIST_MODELS + ("fortunes-lstm",)
#: characters of Debian's fortunes files as ``fortunes_text.load_fortunes`` reads them (tested against it)
FORTUNES_VOCAB = 112
WINDOW = 64  # characters per window of fortunes-lstm's batches


def fmnist_cnn(width: int = 32) -> nn.Module:
    """The CNN above; ``width`` (32) channels in the first convolution, twice as many in the second."""
    hidden = 12 * width  # 384 at the default width
    return nn.Sequential(
        nn.Conv2d(1, width, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(2 * width * 7 * 7, hidden), nn.ReLU(), nn.Linear(hidden, 10),
    )


def fmnist_resnet20(width: int = 32) -> nn.Module:
    """ResNet-20 for 1x28x28 images, ``width`` (32) channels in its first stage, 64 and 128 in the others."""
    return build_model("resnet20", width=width, in_channels=1)


class CharLSTM(nn.Module):
    """Characters in, next-character logits out: embedding 64, LSTM 128, linear head."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 64)
        self.lstm = nn.LSTM(64, 128, batch_first=True)
        self.head = nn.Linear(128, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(self.embed(x))[0])


def build_bench_model(name: str, width: Optional[int] = None) -> nn.Module:
    """The model ``name`` of :data:`MODELS`; ``width`` narrows it (tests; not the LSTM)."""
    if name == "fortunes-lstm":
        return CharLSTM(FORTUNES_VOCAB)
    if name == "fmnist-cnn":
        return fmnist_cnn() if width is None else fmnist_cnn(width)
    if name == "fmnist-resnet20":
        return fmnist_resnet20() if width is None else fmnist_resnet20(width)
    return build_model(name, width=width)


def synthetic_batch(name: str, rank: int, batch: int, image_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """A fixed random batch of ``name``'s input shape (timing only): 1x28x28 for the Fashion-MNIST models, windows of 64
    characters for fortunes-lstm (``image_size`` ignored by both), else 3 x ``image_size`` x ``image_size``;
    different on each rank."""
    g = torch.Generator().manual_seed(1000 + rank)
    if name == "fortunes-lstm":
        chars = torch.randint(0, FORTUNES_VOCAB, (batch, WINDOW + 1), generator=g)
        return chars[:, :-1].contiguous(), chars[:, 1:].contiguous()
    shape = (1, 28, 28) if name in FASHION_MNIST_MODELS else (3, image_size, image_size)
    return torch.randn(batch, *shape, generator=g), torch.randint(0, 10, (batch,), generator=g)

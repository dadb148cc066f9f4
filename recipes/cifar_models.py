"""Models for 32x32 images: torchvision's ResNet-18 with a CIFAR stem, and the CIFAR ResNet family.

The CIFAR ResNets follow He et al., "Deep Residual Learning for Image
Recognition" (2016), section 4.2: a 3x3 stem, then three stages of ``n``
basic blocks with 16, 32 and 64 channels (``6n + 2`` layers: resnet20 has
n=3, resnet32 n=5, resnet44 n=7, resnet56 n=9), global average pooling and
a linear classifier. Shortcuts that change shape are the paper's option A:
subsample by the stride and pad the new channels with zeros, so the shortcut
has no parameters.

``width`` scales the channel counts (16 for the paper's models); a small
width makes a model for fast tests. Average pooling is adaptive, so inputs
smaller than 32x32 work too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MODELS", "build_model", "CifarResNet", "small_cnn"]


def small_cnn(seed: int) -> nn.Sequential:
    """A small CNN for 28x28 greyscale images (Fashion-MNIST): convolutions 1-16 and 16-32 of 5x5 and 32-32 of
    3x3, each with ReLU and 2x2 max-pooling, then linear 288-10; 25,386 parameters in 8 tensors, no batch norm."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 16, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 3 * 3, 10))

# depth -> blocks per stage, for the paper's four CIFAR models.
_CIFAR_DEPTHS = {"resnet20": 3, "resnet32": 5, "resnet44": 7, "resnet56": 9}
MODELS = ("resnet18",) + tuple(_CIFAR_DEPTHS)


class _BasicBlock(nn.Module):
    def __init__(self, in_channels: int, channels: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.stride = stride
        self.extra_channels = channels - in_channels

    def _shortcut(self, x: torch.Tensor) -> torch.Tensor:
        # Option A: no parameters, subsample and zero-pad channels.
        if self.stride != 1:
            x = x[:, :, :: self.stride, :: self.stride]
        if self.extra_channels:
            x = F.pad(x, (0, 0, 0, 0, 0, self.extra_channels))
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self._shortcut(x))


class CifarResNet(nn.Module):
    """ResNet with ``6 * blocks_per_stage + 2`` layers for CIFAR-sized inputs.

    Args:
        blocks_per_stage (int): basic blocks in each of the three stages.
        num_classes (int): outputs of the classifier.
        width (int): channels of the first stage (16 in the paper); the
            second and third stages have twice and four times as many.
        in_channels (int): channels of the input images (3: colour; 1: greyscale).
    """

    def __init__(self, blocks_per_stage: int, num_classes: int = 10, width: int = 16, in_channels: int = 3):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, width, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(width)
        stages = []
        in_channels = width
        for i, channels in enumerate((width, 2 * width, 4 * width)):
            blocks = []
            for b in range(blocks_per_stage):
                stride = 2 if (i > 0 and b == 0) else 1
                blocks.append(_BasicBlock(in_channels, channels, stride))
                in_channels = channels
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(in_channels, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.conv(x)))
        x = self.stages(x)
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.fc(x)


def _resnet18_cifar(num_classes: int, width: int, in_channels: int = 3) -> nn.Module:
    """torchvision's ResNet-18 with a 3x3 stride-1 stem and no max-pool (for 32x32 inputs)."""
    from torchvision.models.resnet import BasicBlock, ResNet

    model = ResNet(BasicBlock, [2, 2, 2, 2], num_classes=num_classes)
    if width != 64:
        # torchvision's BasicBlock only takes width_per_group=64: narrow the
        # model by rebuilding its stages with fewer planes instead.
        model.inplanes = width
        model.bn1 = nn.BatchNorm2d(width)
        model.layer1 = model._make_layer(BasicBlock, width, 2)
        model.layer2 = model._make_layer(BasicBlock, 2 * width, 2, stride=2)
        model.layer3 = model._make_layer(BasicBlock, 4 * width, 2, stride=2)
        model.layer4 = model._make_layer(BasicBlock, 8 * width, 2, stride=2)
        model.fc = nn.Linear(8 * width, num_classes)
    model.conv1 = nn.Conv2d(in_channels, width, 3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


def build_model(name: str, num_classes: int = 10, width: int | None = None, in_channels: int = 3) -> nn.Module:
    """Build one of :data:`MODELS`.

    Args:
        name (str): ``resnet18`` or ``resnet20``/``resnet32``/``resnet44``/``resnet56``.
        num_classes (int): classifier outputs.
        width (int, optional): first-stage channels; default 64 for resnet18
            and 16 for the CIFAR ResNets (the published models).
        in_channels (int): channels of the input images (3: colour; 1: greyscale).
    """
    if name == "resnet18":
        return _resnet18_cifar(num_classes, 64 if width is None else width, in_channels)
    if name in _CIFAR_DEPTHS:
        return CifarResNet(_CIFAR_DEPTHS[name], num_classes, 16 if width is None else width, in_channels)
    raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")

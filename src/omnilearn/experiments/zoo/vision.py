"""CIFAR-style image classifiers, written here (no torchvision, no downloads).

Every model takes ``(N, C, H, W)`` images with any channel count ``C`` and
any ``H, W >= 8``, and returns ``(N, num_classes)`` logits. An adaptive
average pool sits before each classifier, so the image size never changes
the parameter count. Use them through :func:`omnilearn.experiments.zoo.models.build`, or
directly::

    from omnilearn.experiments.zoo.vision import resnet18
    model = resnet18(in_channels=3, num_classes=10)   # 11,173,962 parameters

``resnet18`` / ``resnet50``: the CIFAR variant of ResNet (3x3 stride-1 stem,
no max-pool; BasicBlock [2, 2, 2, 2] / Bottleneck [3, 4, 6, 3], widths
64-128-256-512, BatchNorm). ``alexnet``: a CIFAR-sized AlexNet (5 convs
64-192-384-256-256, 3x3 kernels, three 2x2 max-pools, 2x2 adaptive pool, a
classifier of two 1024-wide hidden layers with dropout 0.5; 1024 rather than
ImageNet's 4096 keeps it modest at 32x32). ``vgg11``: VGG-11 with BatchNorm,
as commonly trained on CIFAR, with a single linear classifier.

Parameters at 3 channels: resnet18 11,173,962 (10 classes), resnet50
23,705,252 (100 classes), alexnet 4,361,034 and vgg11 9,231,114 (10 classes).

Max-pools are :class:`SafeMaxPool`: they halve the image but leave it alone
once a side is already 1, so small images never shrink to nothing.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class SafeMaxPool(nn.Module):
    """2x2 stride-2 max-pool that is skipped when height or width is already 1."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if min(x.shape[-2:]) < 2:
            return x
        return F.max_pool2d(x, 2)


def _conv_bn(cin: int, cout: int, kernel: int, stride: int = 1) -> nn.Sequential:
    """Conv (no bias) then BatchNorm; padding keeps the size at stride 1."""
    return nn.Sequential(
        nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2, bias=False),
        nn.BatchNorm2d(cout),
    )


def _shortcut(cin: int, cout: int, stride: int) -> nn.Module:
    """Identity when shapes agree, else a 1x1 projection with BatchNorm."""
    if stride == 1 and cin == cout:
        return nn.Identity()
    return _conv_bn(cin, cout, 1, stride)


class BasicBlock(nn.Module):
    """Two 3x3 convs with a residual connection (ResNet-18/34)."""

    expansion = 1

    def __init__(self, cin: int, width: int, stride: int = 1) -> None:
        super().__init__()
        self.body = nn.Sequential(
            _conv_bn(cin, width, 3, stride), nn.ReLU(inplace=True), _conv_bn(width, width, 3))
        self.shortcut = _shortcut(cin, width, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.shortcut(x))


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carrying the stride), 1x1 expand by 4 (ResNet-50+)."""

    expansion = 4

    def __init__(self, cin: int, width: int, stride: int = 1) -> None:
        super().__init__()
        cout = width * self.expansion
        self.body = nn.Sequential(
            _conv_bn(cin, width, 1), nn.ReLU(inplace=True),
            _conv_bn(width, width, 3, stride), nn.ReLU(inplace=True),
            _conv_bn(width, cout, 1))
        self.shortcut = _shortcut(cin, cout, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.shortcut(x))


class ResNet(nn.Module):
    """CIFAR ResNet: 3x3 stem, four stages (strides 1, 2, 2, 2), pool, linear."""

    def __init__(self, block: type[BasicBlock] | type[Bottleneck], depths: list[int],
                 in_channels: int, num_classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(_conv_bn(in_channels, 64, 3), nn.ReLU(inplace=True))
        stages, cin = [], 64
        for i, (width, depth) in enumerate(zip((64, 128, 256, 512), depths)):
            for j in range(depth):
                stride = 2 if i > 0 and j == 0 else 1
                stages.append(block(cin, width, stride))
                cin = width * block.expansion
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)
        self._init_weights()

    def _init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pool(self.stages(self.stem(x)))
        return self.fc(h.flatten(1))


def resnet18(in_channels: int, num_classes: int) -> ResNet:
    return ResNet(BasicBlock, [2, 2, 2, 2], in_channels, num_classes)


def resnet50(in_channels: int, num_classes: int) -> ResNet:
    return ResNet(Bottleneck, [3, 4, 6, 3], in_channels, num_classes)


class AlexNet(nn.Module):
    """CIFAR-sized AlexNet; see the module docstring for the layer sizes."""

    def __init__(self, in_channels: int, num_classes: int, hidden: int = 1024) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 64, 3, padding=1), nn.ReLU(inplace=True), SafeMaxPool(),
            nn.Conv2d(64, 192, 3, padding=1), nn.ReLU(inplace=True), SafeMaxPool(),
            nn.Conv2d(192, 384, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(384, 256, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(256, 256, 3, padding=1), nn.ReLU(inplace=True), SafeMaxPool(),
        )
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.classifier = nn.Sequential(
            nn.Dropout(0.5), nn.Linear(256 * 2 * 2, hidden), nn.ReLU(inplace=True),
            nn.Dropout(0.5), nn.Linear(hidden, hidden), nn.ReLU(inplace=True),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pool(self.features(x))
        return self.classifier(h.flatten(1))


def alexnet(in_channels: int, num_classes: int) -> AlexNet:
    return AlexNet(in_channels, num_classes)


VGG11 = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")


class VGG(nn.Module):
    """VGG with BatchNorm after every conv; ``"M"`` in the config is a max-pool."""

    def __init__(self, config: tuple[int | str, ...], in_channels: int, num_classes: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        cin = in_channels
        for item in config:
            if item == "M":
                layers.append(SafeMaxPool())
            else:
                cout = int(item)
                layers += [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout),
                           nn.ReLU(inplace=True)]
                cin = cout
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pool(self.features(x))
        return self.classifier(h.flatten(1))


def vgg11(in_channels: int, num_classes: int) -> VGG:
    return VGG(VGG11, in_channels, num_classes)

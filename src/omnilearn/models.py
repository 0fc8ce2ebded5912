"""Built-in models. Plain ``nn.Module``s: they know nothing of ranks or workers.

``cnn1d``: a small 1-D CNN for 40-long signals (MNIST-1D), no BatchNorm or
dropout, so training is a deterministic function of the global batch
sequence. ``mlp``: a two-layer perceptron baseline.
"""

from __future__ import annotations

import math

from torch import nn

MODELS = ("cnn1d", "mlp")


class CNN1d(nn.Module):
    def __init__(self, length: int, num_classes: int, channels: int = 64) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv1d(1, channels, 5, padding=2),
            nn.ReLU(),
            nn.Conv1d(channels, channels, 3, padding=1, stride=2),
            nn.ReLU(),
            nn.Conv1d(channels, channels, 3, padding=1, stride=2),
            nn.ReLU(),
        )
        out_len = math.ceil(math.ceil(length / 2) / 2)
        self.head = nn.Linear(channels * out_len, num_classes)

    def forward(self, x):
        h = self.features(x.unsqueeze(1))
        return self.head(h.flatten(1))


class MLP(nn.Module):
    def __init__(self, length: int, num_classes: int, hidden: int = 256) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(length, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))

    def forward(self, x):
        return self.net(x.flatten(1))


def build(name: str, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    length = math.prod(input_shape)
    if name == "cnn1d":
        return CNN1d(length, num_classes)
    if name == "mlp":
        return MLP(length, num_classes)
    raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")

"""Built-in models. Plain ``nn.Module``s: they know nothing of ranks or workers.

Build one with ``build(name, input_shape, num_classes)``, where
``input_shape`` is one sample's shape (no batch dimension).

``cnn1d``: a small 1-D CNN for 40-long signals (MNIST-1D), no BatchNorm or
dropout, so training is a deterministic function of the global batch
sequence. ``mlp``: a two-layer perceptron baseline. Both flatten any shape.

Image classifiers (:mod:`omnilearn.experiments.zoo.vision`) ``resnet18``, ``resnet50``,
``alexnet``, ``vgg11`` need ``input_shape == (C, H, W)``; C is taken from it.

Language models (:mod:`omnilearn.experiments.zoo.gpt`) ``gpt2`` (the real GPT-2 small
shape, block 1024 or T if longer) and ``gpt2-tiny`` (2 layers, 4 heads,
128 wide, block T) need ``input_shape == (T,)``: token ids, not floats. For
language modelling the "classes" are the next token's vocabulary, so
``num_classes`` is the vocabulary size; they return ``(N, T, vocab)`` logits.
See :func:`is_language_model`. The vision and GPT modules are imported
lazily inside :func:`build`, so importing this module stays cheap.
"""

from __future__ import annotations

import math

from torch import nn

from omnilearn.experiments.catalog import LANGUAGE_MODELS, MODELS, VISION_MODELS, is_language_model  # noqa: F401


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
        h = self.features(x.flatten(1).unsqueeze(1))  # any sample shape, read as one signal
        return self.head(h.flatten(1))


class MLP(nn.Module):
    def __init__(self, length: int, num_classes: int, hidden: int = 256) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(length, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))

    def forward(self, x):
        return self.net(x.flatten(1))


def _shape_text(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(d) for d in shape) + (",)" if len(shape) == 1 else ")")


def _build_vision(name: str, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    if len(input_shape) != 3:
        raise ValueError(
            f"model {name} needs image inputs (channels, height, width); dataset gives shape "
            f"{_shape_text(input_shape)}; use --dataset cifar10, imagefolder or synthetic "
            f"with --input-shape 3x32x32")
    from omnilearn.experiments.zoo import vision

    return getattr(vision, name)(in_channels=input_shape[0], num_classes=num_classes)


def _build_gpt(name: str, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    if len(input_shape) != 1:
        raise ValueError(
            f"model {name} needs token sequences of shape (sequence_length,); dataset gives "
            f"shape {_shape_text(input_shape)}; use --dataset text")
    from omnilearn.experiments.zoo.gpt import GPT, SIZES

    length = input_shape[0]
    block_size = max(1024, length) if name == "gpt2" else length
    return GPT(SIZES[name](vocab_size=num_classes, block_size=block_size))


def build(name: str, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """The model ``name`` for samples of ``input_shape``; for GPTs ``num_classes`` is the vocabulary."""
    input_shape = tuple(input_shape)
    if name in VISION_MODELS:
        return _build_vision(name, input_shape, num_classes)
    if name in LANGUAGE_MODELS:
        return _build_gpt(name, input_shape, num_classes)
    length = math.prod(input_shape)
    if name == "cnn1d":
        return CNN1d(length, num_classes)
    if name == "mlp":
        return MLP(length, num_classes)
    raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")

"""The names of the harness's models and datasets, without building any (no torch): what the config validates.

:mod:`omnilearn.experiments.zoo.models` builds the models,
:mod:`omnilearn.experiments.datasets.core` loads the datasets; both take their
names from here, so reading a config (the TensorFlow job's workers do) imports no torch.
"""

from __future__ import annotations

DATASETS = ("mnist1d", "synthetic", "cifar10", "cifar100", "imagefolder", "text")
VISION_MODELS = ("resnet18", "resnet50", "alexnet", "vgg11")
LANGUAGE_MODELS = ("gpt2", "gpt2-tiny")
MODELS = ("cnn1d", "mlp", *VISION_MODELS, *LANGUAGE_MODELS)


def is_language_model(name: str) -> bool:
    """True for models that take ``(N, T)`` token ids and return ``(N, T, vocab)`` logits."""
    return name in LANGUAGE_MODELS

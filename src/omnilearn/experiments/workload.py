"""The CLI's workload: dataset, model, optimizer, learning-rate schedule, loss and evaluation.

Shared by the OmniLearn trainer (``trainer.py``) and the plain-DDP baseline
(``plainddp.py``) so both train exactly the same thing. Nothing here knows
about batch balancing; users of the Python API bring their own of all this.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from omnilearn.experiments.datasets import core as data

from omnilearn.experiments.zoo import models
from omnilearn.experiments.config import ConfigError, TrainConfig
from omnilearn.runplan import RunPlan, plan_run
from omnilearn.distributed.collect import sum_across
from omnilearn.distributed.group import DistContext

EVAL_CHUNK = 512  # test samples per forward pass
DATA_SEED = 0
PREFETCH_FACTOR = 2  # DataLoader batches in flight per loader worker


def data_spec(cfg: TrainConfig) -> data.DataSpec:
    # The data (synthetic samples, the image-folder split) never depends on --seed: runs with different
    # seeds are scored on the same test set.
    return data.DataSpec(cfg.dataset, cfg.data_dir, cfg.sample_shape, cfg.num_classes, cfg.image_size,
                         cfg.seq_len, cfg.augment, DATA_SEED)


def load_data(cfg: TrainConfig) -> data.Splits:
    """The dataset of ``cfg``; a missing or malformed one is a one-line :class:`ConfigError`."""
    try:
        return data.load(data_spec(cfg))
    except data.DataError as e:
        raise ConfigError(str(e)) from None


def build_model(cfg: TrainConfig, splits: data.Splits) -> nn.Module:
    """The model of ``cfg`` for this data, seeded with ``--seed`` so every rank starts from the same weights.

    Every rank draws the same numbers from here on; the session reseeds each
    rank with ``(seed, rank)`` when it wraps the model, so dropout masks and
    augmentations differ between ranks during training.
    """
    torch.manual_seed(cfg.seed)
    try:
        return models.build(cfg.model, splits.input_shape, splits.num_classes)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check(cfg: TrainConfig) -> data.Splits:
    """Fail fast in the launcher: the data loads and the model fits it (built on the meta device, free)."""
    splits = load_data(cfg)
    with torch.device("meta"):
        build_model(cfg, splits)
    return splits


def make_optimizer(cfg: TrainConfig, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def make_schedule(cfg: TrainConfig, opt: torch.optim.Optimizer, total_steps: int, steps_per_epoch: int):
    """Stepped once per training step: cosine over the run, milestones in epochs, or constant."""
    if cfg.lr_schedule == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total_steps)
    if cfg.lr_schedule == "multistep":
        steps = [m * steps_per_epoch for m in cfg.milestone_epochs]
        return torch.optim.lr_scheduler.MultiStepLR(opt, milestones=steps, gamma=cfg.gamma)
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)


def criterion(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy; for language models over every position (logits ``(N, T, V)``, target ``(N, T)``)."""
    return F.cross_entropy(logits.flatten(0, -2), target.flatten())


@torch.no_grad()
def evaluate(model: nn.Module, test, ctx: DistContext) -> tuple[float, float]:
    """(mean loss, accuracy) over the whole test split, each rank scoring its share of it."""
    was_training = model.training
    model.eval()
    idx = torch.arange(ctx.rank, len(test), ctx.world_size)
    loss_sum = correct = count = 0.0
    for chunk in idx.split(EVAL_CHUNK):
        x, y = test.__getitems__(chunk.tolist())
        logits = model(x.to(ctx.device))
        y = y.to(ctx.device)
        loss_sum += F.cross_entropy(logits.flatten(0, -2), y.flatten(), reduction="sum").item()
        correct += (logits.argmax(-1) == y).sum().item()
        count += y.numel()
    model.train(was_training)
    loss_sum, correct, count = sum_across(ctx, [loss_sum, correct, count])
    return loss_sum / count, correct / count


def resolve(cfg: TrainConfig, dataset_len: int) -> RunPlan:
    """The CLI's plan: ``--epochs`` or ``--max-steps``, prefetch from ``--loader-workers`` (in index lists)."""
    spe = max(1, dataset_len // cfg.global_batch)
    total = spe * cfg.epochs if cfg.max_steps is None else min(cfg.max_steps, spe * cfg.epochs)
    return plan_run(cfg, dataset_len, total, cfg.loader_workers * PREFETCH_FACTOR, f"{cfg.dataset} training set")

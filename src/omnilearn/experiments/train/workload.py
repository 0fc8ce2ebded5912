"""The CLI's workload: dataset, model, optimizer, learning-rate schedule, loss and evaluation.

Shared by the OmniLearn trainer (``trainer.py``) and the plain-DDP baseline
(``plainddp.py``) so both train exactly the same thing. Nothing here knows
about batch balancing; users of the Python API bring their own of all this.
The launcher's look before any worker starts (:func:`look`: the data, the
model's size, the run's length, each said in one line, and warnings about a
run that goes on, :func:`run_warnings`) lives here too.
"""

from __future__ import annotations

import os
import time
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from omnilearn.experiments.datasets import core as data

from omnilearn.experiments.zoo import models
from omnilearn.experiments.config import ConfigError, TrainConfig
from omnilearn.runplan import RunPlan, late_changes_text, plan_run
from omnilearn.distributed.collect import sum_across
from omnilearn.distributed.group import DistContext, launched_by_torchrun, pick_device
from omnilearn.observe.console import startup, took, warn

EVAL_CHUNK = 512  # test samples per forward pass
DATA_SEED = 0
PREFETCH_FACTOR = 2  # DataLoader batches in flight per loader worker
LARGE_CPU_MODEL = 20_000_000  # parameters above which training on the CPU gets a warning (gpt2: 86M, resnet50: 24M)
SMALLER_MODEL = {"gpt2": "gpt2-tiny", "resnet50": "resnet18"}  # what to suggest instead on a CPU


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
    parameters(cfg, splits)
    return splits


def look(cfg: TrainConfig) -> int:
    """The launcher's look before any process starts (fail fast): load the data, build the model on the meta
    device and plan the run, saying so (the launcher, or torchrun's rank 0; not when quiet) and warning about a
    run that will not do what it says. Returns the run's length in steps."""
    main_rank = not launched_by_torchrun() or os.environ.get("RANK") == "0"
    quiet = cfg.quiet or not main_rank
    first = cfg.dataset == "mnist1d" and not data.mnist1d_cache().exists()  # generated once: seconds
    startup(f"checking the data ({cfg.dataset}{', generating it once' if first else ''}) and the model "
            f"({cfg.model}) ...", quiet)
    start = time.perf_counter()
    splits = load_data(cfg)
    startup(f"data: {describe_data(cfg, splits)}; ready in {took(time.perf_counter() - start)}", quiet)
    params = parameters(cfg, splits)
    startup(f"model: {cfg.model}, {params:,} parameters", quiet)
    plan = resolve(cfg, len(splits.train))
    device = pick_device(cfg.device, 0, int(os.environ.get("LOCAL_WORLD_SIZE", cfg.workers))).type
    for line in run_warnings(cfg, plan, params, device) if main_rank else ():
        warn(line)
    return plan.total_steps


def parameters(cfg: TrainConfig, splits: data.Splits) -> int:
    """The model's parameter count, built on the meta device (free); a model that does not fit the data raises."""
    with torch.device("meta"):
        return sum(p.numel() for p in build_model(cfg, splits).parameters())


def describe_data(cfg: TrainConfig, splits: data.Splits) -> str:
    """``mnist1d: 10,000 training + 2,500 test samples (read from the cache)``."""
    source = splits.source.split(": ", 1)[-1] if splits.source else ""
    return (f"{cfg.dataset}: {len(splits.train):,} training + {len(splits.test):,} test samples"
            + (f" ({source})" if source else ""))


def run_warnings(cfg: TrainConfig, plan: RunPlan, params: int, device: str) -> list[str]:
    """One line each, for ``omnilearn: warning:``: schedule changes the run never reaches, a big model on a CPU."""
    out = []
    if plan.late_changes:
        full = plan.steps_per_epoch * cfg.epochs
        if plan.total_steps < full and plan.late_changes[0] < full:
            end, knob = f"--max-steps {cfg.max_steps} cuts the {full} steps of --epochs {cfg.epochs} short", \
                "--max-steps"
        else:
            end, knob = f"--epochs {cfg.epochs} of {plan.steps_per_epoch} steps", "--epochs"
        out.append(late_changes_text(cfg, plan, end, knob))
    if device == "cpu" and params > LARGE_CPU_MODEL:
        out.append(_big_model_on_cpu(cfg, params))
    return out


def _big_model_on_cpu(cfg: TrainConfig, params: int) -> str:
    preset = f" (from --preset {cfg.preset})" if cfg.preset else ""
    if cfg.device == "cpu":
        why, fix = "--device cpu", "use --device cuda on a machine with a GPU"
    elif torch.cuda.is_available():
        why, fix = f"{torch.cuda.device_count()} GPUs for {cfg.workers} local workers", "use one GPU per worker"
    else:
        why, fix = "no CUDA device here", "use a machine with a GPU"
    smaller = SMALLER_MODEL.get(cfg.model)
    return (f"model {cfg.model}{preset} has {params / 1e6:.1f}M parameters and would train on the CPU ({why}): "
            f"expect seconds to minutes per step; {fix}{f', or --model {smaller} for a CPU run' if smaller else ''}")


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
    return plan_run(cfg, dataset_len, total, cfg.loader_workers * PREFETCH_FACTOR, f"{cfg.dataset} training set",
                    warn=False)  # the launcher says it once, as a flag-worded line: run_warnings

"""Which ``TrainingArguments`` ``OmniLearnTrainer`` honours, which it refuses, and how it maps them onto a session.

``OmniLearnTrainer`` replaces Trainer's training loader, sampler, DDP wrap and
checkpoint contents, so every ``TrainingArguments`` field those read is
either carried over here or refused in one line naming the field and the
fix (docs/huggingface.md lists them all). Nothing is dropped:

- :func:`refusals`: the settings the door cannot honour, each a one-line reason.
- :func:`session_settings`: ``omnilearn.setup`` keywords from Trainer's batch,
  accumulation, steps and seed (``data_seed``, else ``seed``, as Trainer's
  sampler seeds), with the user's ``omnilearn=dict(...)`` on top.
- :func:`ddp_kwargs`: the DDP keywords Trainer hands accelerate
  (``ddp_find_unused_parameters``, ``ddp_bucket_cap_mb`` and Trainer's own
  default for unused parameters), for ``Session.wrap_model``.

``torch_compile=True`` is honoured: accelerate compiles the wrapped model
(``torch.compile(ol.wrap_model(model))``, docs/compile.md).

Run: ``python -m pytest -q tests/unit/test_hf_private_names.py tests/dist/test_hf_trust.py tests/dist/test_hf_compile.py``
"""

from __future__ import annotations

import re
from typing import Any

from omnilearn.config import ConfigError

SAMPLING = "random"  # the one train_sampling_strategy the session's sampler is (a seeded shuffle per epoch)


def _parallel_refusals(args: Any) -> list[str]:
    bad = []
    if getattr(args, "deepspeed", None):
        bad.append(f"deepspeed={args.deepspeed!r}: OmniLearn balances DDP only; drop deepspeed")
    if getattr(args, "fsdp", None):
        bad.append(f"fsdp={args.fsdp!r}: OmniLearn's Trainer wraps DDP only; drop fsdp, or for a sharded model "
                   "train it in your own loop with fully_shard and ol.wrap_model (docs/fsdp.md)")
    if getattr(args, "parallelism_config", None) is not None:
        bad.append("parallelism_config (tensor/context parallelism): OmniLearn's Trainer is data parallel only; "
                   "drop parallelism_config")
    if args.n_gpu > 1:
        bad.append(f"{args.n_gpu} GPUs in one process (DataParallel): launch one process per GPU with torchrun")
    if args.ddp_broadcast_buffers:
        bad.append("ddp_broadcast_buffers=True: OmniLearn averages buffers by batch share instead of copying rank "
                   "0's every forward; drop ddp_broadcast_buffers (or set it False)")
    if args.ddp_static_graph:
        bad.append("ddp_static_graph=True: DDP's static graph breaks on OmniLearn's per micro-batch sync (a reducer "
                   "assertion at the second step); drop ddp_static_graph")
    return bad


def _data_refusals(args: Any) -> list[str]:
    bad = []
    strategy = getattr(args, "train_sampling_strategy", SAMPLING)
    if strategy != SAMPLING:
        bad.append(f"train_sampling_strategy={strategy!r}: OmniLearn's sampler (a seeded shuffle per epoch, split "
                   f"by worker speed) replaces Trainer's; use train_sampling_strategy={SAMPLING!r}")
    if args.dataloader_persistent_workers:
        bad.append("dataloader_persistent_workers=True: OmniLearn's loader makes its own workers; drop it")
    if args.dataloader_multiprocessing_context is not None:
        bad.append(f"dataloader_multiprocessing_context={args.dataloader_multiprocessing_context!r}: OmniLearn's "
                   "loader uses the default start method; drop it")
    if not args.dataloader_in_order:
        bad.append("dataloader_in_order=False: OmniLearn's loader hands out batches in order (the split is per "
                   "sample); drop it")
    if args.auto_find_batch_size:
        bad.append("auto_find_batch_size=True: OmniLearn sets the batches; use omnilearn=dict(max_batch=...)")
    if args.ignore_data_skip:
        bad.append("ignore_data_skip=True: a resumed OmniLearn run always continues the data; drop it")
    return bad


def refusals(args: Any) -> list[str]:
    """The ``TrainingArguments`` OmniLearnTrainer cannot honour, each as a one-line reason with its fix."""
    bad = []
    if args.fp16:
        bad.append("fp16=True (its GradScaler scales the loss outside OmniLearn's weighting): use bf16=True or fp32")
    if getattr(args, "enable_jit_checkpoint", False):
        bad.append("enable_jit_checkpoint=True: it checkpoints on one rank's SIGTERM, a collective the others "
                   "miss; OmniLearn's session agrees a stop signal on every rank and checkpoints; drop it")
    return bad + _parallel_refusals(args) + _data_refusals(args)


def session_settings(args: Any, omnilearn: dict | None) -> dict[str, Any]:
    """``omnilearn.setup`` keywords: Trainer's batch, accumulation, device, steps and data seed, then ``omnilearn``."""
    settings = dict(omnilearn or {})
    k = args.gradient_accumulation_steps
    if settings.setdefault("accumulation_steps", k) != k:
        raise ConfigError(f"omnilearn=dict(accumulation_steps={settings['accumulation_steps']}) differs from "
                          f"gradient_accumulation_steps={k}: give gradient_accumulation_steps only")
    if "global_batch" not in settings:
        settings.setdefault("local_batch", args.per_device_train_batch_size * k)
    settings.setdefault("device", "cuda" if args.device.type == "cuda" else "cpu")
    settings.setdefault("seed", args.data_seed if args.data_seed is not None else args.seed)
    settings.setdefault("total_steps", args.max_steps if args.max_steps > 0 else None)
    return settings


def ddp_kwargs(handler_kwargs: dict[str, Any]) -> dict[str, Any]:
    """What Trainer passes DDP through accelerate's ``ddp_handler``, for ``Session.wrap_model``.

    ``broadcast_buffers=False`` is what the session does anyway (True is refused in :func:`refusals`).
    """
    kwargs = dict(handler_kwargs)
    if kwargs.pop("broadcast_buffers", False):
        raise ConfigError("ddp_broadcast_buffers=True: OmniLearn averages buffers by batch share; drop it")
    return kwargs


_SETUP_KEYWORD = re.compile(r"(\w+)=(\S+) \(omnilearn\.setup keyword[^)]*\)")


def in_door_words(message: str) -> str:
    """A core refusal's fix in this door's words: ``seed=3 (omnilearn.setup keyword; ...)`` -> ``omnilearn=dict(seed=3)``."""
    return _SETUP_KEYWORD.sub(r"omnilearn=dict(\1=\2)", message)

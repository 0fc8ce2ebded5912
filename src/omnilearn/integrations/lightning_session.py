"""What the two Lightning doors hand the OmniLearn session: the batch the framework would use, and a resume refused in the door's words.

- :func:`with_loader_batch` (``OmniLearnStrategy``): when the strategy was
  given neither ``global_batch`` nor ``local_batch``, the batch is taken
  from where Lightning takes it, as DDP would train: the training
  ``DataLoader``'s ``batch_size`` x ``accumulate_grad_batches`` per process
  (``local_batch``), x the processes. A given ``global_batch``/``local_batch``
  wins over the ``DataLoader``'s ``batch_size`` (OmniLearn sets each
  worker's batch; docs/lightning.md says so).
- :func:`check_loader_batch` (``OmniLearnFabricStrategy``): Fabric opens the
  session at ``fabric.setup(model)``, before it sees the data; with no batch
  setting, a training ``DataLoader`` whose ``batch_size`` x
  ``accumulation_steps`` x processes is not the session's global batch is
  refused in one line naming the ``local_batch=`` that matches it.
- :func:`continued_run`: a fit that continues a run (a checkpoint, or the
  previous fit) appends to the run directory ``out`` already holds.
- :func:`load_resumed`: ``Session.load_state_dict``; a checkpoint the session
  refuses (another global batch, seed, dataset length...) is a
  :class:`~omnilearn.config.ConfigError` in one line naming the door and its
  keywords (``seed=0 (an OmniLearnStrategy keyword)``, not the CLI's
  ``--seed 0``).

Run: ``python -m pytest -q tests/dist/test_lightning_trust.py tests/dist/test_lightning_resume.py``
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Callable

import torch

from omnilearn.config import ConfigError, api_wording
from omnilearn.distributed.group import join_torchrun

BATCH_KEYWORDS = ("global_batch", "local_batch")
_CORE_KEYWORD = re.compile(r" \(omnilearn\.setup keyword; omnilearn train --[a-z-]+ \S+\)")


def _batch_size(loader: Any, who: str) -> int:
    size = getattr(loader, "batch_size", None)
    if type(size) is not int or size < 1:
        raise ConfigError(f"{who} got no global_batch or local_batch and the training data ({type(loader).__name__}, "
                          f"batch_size={size!r}) gives none to take: give {who}(global_batch=B)")
    return size


def with_loader_batch(settings: dict[str, Any], training_data: Callable[[], Any], accumulation: int,
                      who: str) -> dict[str, Any]:
    """``settings`` with ``local_batch = batch_size x accumulation`` when they give no batch (module docstring)."""
    if any(name in settings for name in BATCH_KEYWORDS):
        return settings
    return {**settings, "local_batch": _batch_size(training_data(), who) * accumulation}


def check_loader_batch(settings: dict[str, Any], loader: Any, session: Any, who: str) -> None:
    """Refuse a training ``loader`` whose batch disagrees with the session's default batch (module docstring)."""
    if any(name in settings for name in BATCH_KEYWORDS):
        return
    k, world = session.cfg.accumulation_steps, session.world_size
    local = _batch_size(loader, who) * k
    if local * world != session.global_batch:
        raise ConfigError(f"{who} got no global_batch or local_batch, so OmniLearn's global batch is "
                          f"{session.global_batch}, but DataLoader(batch_size={local // k}) x accumulation_steps={k} "
                          f"x {world} processes is {local * world}: give {who}(local_batch={local})")


def join_round_group(strategy: Any) -> None:
    """Both Lightning doors, before their framework makes the process group: under torchrun, make it in a key space
    of this round's own (:func:`omnilearn.distributed.group.join_torchrun`) with the backend and timeout the
    framework would use, so a restart after a lost peer re-forms it whatever torchrun's store sharing (the
    framework's own hung or read the dead attempt's addresses); the framework then finds it made. One process
    alone (``devices=1``, one node, no launcher): a group of one on an in-memory store, no socket (the framework's
    would be torch's TCPStore, listening on every interface, and left open after the fit: one per fit)."""
    if torch.distributed.is_initialized():
        return
    if "TORCHELASTIC_RESTART_COUNT" in os.environ:
        cuda = strategy.root_device if strategy.root_device.type == "cuda" else None
        join_torchrun(strategy._get_process_group_backend(), strategy._timeout, device_id=cuda)
    elif strategy.num_nodes * strategy.num_processes == 1 and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        torch.distributed.init_process_group(strategy._get_process_group_backend(), store=torch.distributed.HashStore(),
                                             rank=0, world_size=1, timeout=strategy._timeout)


def door_wording(message: str, who: str) -> str:
    """The core's refusal in the door's words: ``seed=0 (omnilearn.setup keyword; omnilearn train --seed 0)``
    becomes ``seed=0 (an OmniLearnStrategy keyword)``; CLI flags alone (``--global-batch 60``) become keywords."""
    return api_wording(_CORE_KEYWORD.sub(f" (an {who} keyword)", message))


def load_resumed(session: Any, state: dict, who: str) -> None:
    """``session.load_state_dict(state)``; what it refuses, in one line naming ``who`` and its keywords."""
    try:
        session.load_state_dict(state)
    except ValueError as e:  # ConfigError included
        raise ConfigError(f"{who} cannot resume this checkpoint: {door_wording(str(e), who)}") from None


def continued_run(settings: dict[str, Any], carry: dict | None) -> tuple[dict[str, Any], Path | None]:
    """(``omnilearn.setup()`` keywords, the run directory to append to): a fit that continues a run keeps its record.

    Like ``omnilearn train --resume``: when the session loads a previous state (a checkpoint, or the previous fit)
    and ``out`` already holds a run, the record goes on in it (steps from the resume on; a ``resume`` event voids
    any later records) instead of ``out`` being prepared anew, which would delete it.
    """
    out = settings.get("out")
    if carry is None or out is None or not (Path(out) / "config.toml").is_file():
        return dict(settings), None
    return {k: v for k, v in settings.items() if k not in ("out", "overwrite")}, Path(out)

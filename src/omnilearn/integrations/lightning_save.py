"""Rank 0's ordinary save of both Lightning doors (``trainer.save_checkpoint``, ``ModelCheckpoint``,
``fabric.save``), atomic beside the target: the old file or the new one, whole, even when a path is saved again.

Lightning's own write (``TorchCheckpointIO`` through an fsspec transaction) goes through a temporary file in the
system temp dir: on another filesystem than the checkpoint's, its move copies into the target in place, so a kill
mid-copy leaves a cut checkpoint where the old one was. For a local path with Lightning's default checkpoint IO,
:func:`write_local` serializes as Lightning does and writes with :func:`omnilearn.observe.rundir.write_atomic`
(temp file beside the target, fsync, rename, directory fsync), then sweeps the temp files of writers killed
mid-save (never one a survivor of :mod:`~omnilearn.integrations.lightning_rescue` is writing). A user's own
``checkpoint_io``, ``storage_options`` or a remote URL keep Lightning's route (:func:`local_target`).

Run: ``python -m pytest -q tests/dist/test_lightning_atomic.py``
"""

from __future__ import annotations

import fcntl
import os
import re
from pathlib import Path
from typing import Any

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.plugins.io import TorchCheckpointIO

from omnilearn.commit import start_time
from omnilearn.integrations import lightning_rescue
from omnilearn.observe.rundir import write_atomic


_TEMP = re.compile(r"^\.(.+)\.(\d+)\.tmp$")  # write_atomic's temporary file: ``.<name>.<pid>.tmp`` beside ``name``


def local_target(io: Any, filepath: Any, storage_options: Any) -> Path | None:
    """The local path :func:`write_local` writes for a save through Lightning's default checkpoint IO; None for a
    user's own ``checkpoint_io`` (any other class), ``storage_options`` or a remote fsspec URL: Lightning's route."""
    if type(io) is not TorchCheckpointIO or storage_options is not None:
        return None
    fs, path = fsspec.core.url_to_fs(str(filepath))
    return Path(path) if isinstance(fs, LocalFileSystem) else None


def write_local(path: Path, checkpoint: dict[str, Any]) -> None:
    """``checkpoint`` serialized as Lightning's ``TorchCheckpointIO`` does (``torch.save``), written to ``path``
    atomically beside it (temp file, fsync, rename, directory fsync: the old file or the new one, whole, even when
    ``path`` is saved again); then the temp files of writers killed mid-save are swept. Lightning's own write goes
    through a temp file in the system temp dir: on another filesystem its move copies into ``path`` in place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, lambda f: torch.save(checkpoint, f))
    sweep_cut_writes(path)


def sweep_cut_writes(path: Path) -> None:
    """Remove the temporary files beside ``path`` of writes killed mid-save (``.<name>.<pid>.tmp`` of a name with
    ``path``'s suffix, or ``path``'s name when it has none) whose writer is this process or gone; a survivor's
    that is writing (:mod:`~omnilearn.integrations.lightning_rescue`: it holds its lock, maybe on another host) is
    left alone."""
    kind = path.suffix or path.name
    for p in path.parent.iterdir():
        cut = _TEMP.match(p.name)
        if cut is None or (Path(cut.group(1)).suffix or cut.group(1)) != kind or not p.is_file():
            continue
        pid = int(cut.group(2))
        if (pid == os.getpid() or start_time(pid) is None) and not _held(p.with_name(cut.group(1))):
            p.unlink(missing_ok=True)


def _held(path: Path) -> bool:
    """Whether a survivor holds the lock of ``path`` (writing it now)."""
    lock = lightning_rescue.lock_of(path)
    if not lock.is_file():
        return False
    with open(lock, "a+") as held:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
    return False

"""``OmniLearnTrainer``'s checkpoints: complete or absent, never rotated away before the next one is complete.

A Trainer checkpoint folder (``checkpoint-<step>``) counts only once it
holds :data:`SESSION_FILE` (the session state of every rank). The save is
:func:`omnilearn.commit.commit`, every door's sequence (:func:`save`):
Trainer's folder first, the session file last (temp file, fsync, rename,
directory fsync), then Trainer's ``save_total_limit`` rotation, held back
while Trainer writes the folder (:func:`rotate`: it never removes the
folder just completed). A folder without the file was cut short
(a kill mid-save): ``resume_from_checkpoint=True`` takes the newest
complete folder instead (:func:`latest_complete`, with a warning naming
the cut ones), or refuses in one line when there is none.

Who writes the session file is who Trainer lets write (``args.should_save``):
global rank 0, or with ``save_on_each_node=True`` each node's local rank 0;
rank 0 gathers the state and sends it to the other writers. A failed write
on any writer is raised on every rank, naming the rank (:func:`save`).

Run: ``python -m pytest -q tests/dist/test_hf_trust.py``
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, sort_checkpoints

from omnilearn.bsp.checkpointing import from_bytes, gathered_state, to_bytes
from omnilearn.commit import commit
from omnilearn.config import ConfigError
from omnilearn.distributed.collect import broadcast_bytes, gather_bytes

SESSION_FILE = "omnilearn_session.pt"  # in each checkpoint folder: the session state of every rank; written last
_FOLDER = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


class CutCheckpointWarning(UserWarning):
    """Newer checkpoint folders lack the session file (cut short mid-save): an older complete one is resumed."""


def complete(folder: str | Path) -> bool:
    """Whether a checkpoint folder was finished (its session file, written last, is there)."""
    return (Path(folder) / SESSION_FILE).is_file()


def save(session: Any, folder: str | Path, write_folder: Callable[[], object], *, writer: bool, each_node: bool,
         prune: Callable[[], object]) -> None:
    """Every rank: :func:`omnilearn.commit.commit` with Trainer's folder as the parts (``write_folder``, on every
    rank: Trainer's own save), the session file as the mark and Trainer's rotation as the prune, where Trainer
    saves (``writer``); the others write Trainer's part only. The session state is gathered first (a collective);
    ``each_node``: ranks other than 0 write too, so rank 0 sends them the state. A failure on any rank is raised on
    every rank, naming it; the previous complete checkpoint is kept."""
    state = gathered_state(session)
    if each_node and session.world_size > 1:
        state = from_bytes(broadcast_bytes(session.ctx, to_bytes(state) if session.is_main else None))
    error = ""
    try:
        if writer:
            commit(Path(folder) / SESSION_FILE, write_folder, lambda: to_bytes(state), prune)
        else:
            write_folder()
    except Exception as e:  # every rank raises it, below
        error = f"rank {session.rank}: {type(e).__name__}: {e}"
    errors = gather_bytes(session.ctx, error.encode())
    joined = "; ".join(e.decode() for e in errors or [] if e) if session.is_main else None
    joined = broadcast_bytes(session.ctx, joined.encode() if joined is not None else None).decode()
    if joined:
        raise RuntimeError(f"OmniLearnTrainer: the checkpoint {folder} was not completed ({joined}); the previous "
                           "complete checkpoint is kept")


def rotate(run_dir: str | Path, limit: int | None, keep: str | Path, best: str | None) -> None:
    """Trainer's ``save_total_limit`` rotation (oldest first), never removing ``keep`` (just completed) or ``best``."""
    if limit is None or limit <= 0:
        return
    folders = sort_checkpoints(str(run_dir), use_mtime=True)
    protected = {str(Path(keep))} | ({str(Path(best))} if best else set())
    extra = len(folders) - max(limit, len(protected))
    for folder in folders:
        if extra <= 0:
            break
        if folder not in protected:
            shutil.rmtree(folder, ignore_errors=True)
            extra -= 1


def _step(name: str) -> int:
    return int(_FOLDER.match(name).group(1))


def latest_complete(output_dir: str | Path) -> str:
    """The newest complete checkpoint folder in ``output_dir`` (``resume_from_checkpoint=True``), warning about
    newer cut ones; one line when there is none."""
    names = sorted((n for n in os.listdir(output_dir) if _FOLDER.match(n) and (Path(output_dir) / n).is_dir()),
                   key=_step, reverse=True) if os.path.isdir(output_dir) else []
    cut = [n for n in names if not complete(Path(output_dir) / n)]
    whole = [n for n in names if complete(Path(output_dir) / n)]
    if not whole:
        found = f"only cut-short folders without {SESSION_FILE} ({', '.join(cut)})" if cut else "no checkpoint folder"
        raise ConfigError(f"resume_from_checkpoint=True: {output_dir} holds {found}; give "
                          "resume_from_checkpoint=None to start afresh, or the path of a checkpoint OmniLearnTrainer "
                          "completed")
    newer = [n for n in cut if _step(n) > _step(whole[0])]
    if newer:
        warnings.warn(f"{', '.join(newer)} in {output_dir} lack {SESSION_FILE} (cut short mid-save): resuming "
                      f"{whole[0]}, the newest complete checkpoint", CutCheckpointWarning, stacklevel=3)
    return str(Path(output_dir) / whole[0])

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

The same step saved again (``save_strategy="epoch"`` and a stop signal
mid-epoch: the stop's save, then the epoch's; a run started afresh, or
resumed from an older checkpoint, in an ``output_dir`` holding newer ones):
Trainer writes into an existing folder in place, so the complete folder
is first moved aside (``.checkpoint-<step>.old-<pid>``, the name
:mod:`omnilearn.commit` gives an aside) by the writer, before any rank
writes (:func:`set_aside`); Trainer writes the folder afresh, the mark
commits it, the aside goes, then the rotation. Until the mark, the aside is
that step's checkpoint (:func:`latest_complete` resumes it); the next save
puts it back where its folder is not complete, else removes it
(:func:`omnilearn.commit.recover_directories`).

Who writes the session file is who Trainer lets write (``args.should_save``):
global rank 0, or with ``save_on_each_node=True`` each node's local rank 0;
rank 0 gathers the state and sends it to the other writers. A failed write
on any writer is raised on every rank, naming the rank (:func:`save`).

Run: ``python -m pytest -q tests/dist/test_hf_atomic.py tests/dist/test_hf_trust.py``
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable

import safetensors.torch
import torch
from transformers import PreTrainedModel
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, sort_checkpoints
from transformers.utils import SAFE_WEIGHTS_NAME

from omnilearn.bsp.rescue import RestartStoreWarning, arm  # noqa: F401  (re-exported)
from omnilearn.bsp.checkpointing import from_bytes, gathered_state, session_state, to_bytes
from omnilearn.commit import (claimed, commit, committed_directories, held, recover_directories, start_time,
                              sweep_claims, sync_tree)
from omnilearn.observe.rundir import sync
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
    rank: Trainer's own save; rank r writes ``rng_state_<r>.pth``), the session file as the mark and Trainer's
    rotation as the prune, where Trainer saves (``writer``). In turn, each agreed by every rank (a failure on any
    rank raised on every rank, naming it, before anyone goes on: :func:`_on_every_rank`):

    1. the writer sets a complete folder of this step aside (:func:`set_aside`): no rank writes into it before;
    2. the session state is gathered (``each_node``: ranks other than 0 write too, so rank 0 sends them it), and
       every rank writes Trainer's files: the mark waits for every rank's files;
    3. the writer fsyncs them, writes the mark, removes the aside, then rotates.

    The writer holds the step's claim throughout (:func:`omnilearn.commit.held`, the one a survivor's
    :func:`rescue` of the same step takes): the two saves never interleave. A failure keeps the previous complete
    checkpoint (an aside put back)."""
    folder, aside = Path(folder), []
    with ExitStack() as claim:
        def first() -> None:
            if writer:
                claim.enter_context(held(folder.with_name(f".{folder.name}.claim")))
                aside.append(set_aside(folder))

        _on_every_rank(session, folder, writer, first)
        state = gathered_state(session)
        if each_node and session.world_size > 1:
            state = from_bytes(broadcast_bytes(session.ctx, to_bytes(state) if session.is_main else None))
        _on_every_rank(session, folder, writer, write_folder)

        def finish() -> None:
            if writer:
                commit(folder / SESSION_FILE, lambda: sync_tree(folder), lambda: to_bytes(state),
                       lambda: (drop(aside[0]), prune()))
                sweep_survivors_leftovers(folder.parent)

        _on_every_rank(session, folder, writer, finish)


def _on_every_rank(session: Any, folder: Path, writer: bool, work: Callable[[], object]) -> None:
    """``work()`` here, then agreed: a failure on any rank raises on every rank, naming it, once every rank's work
    ended (the writer first puts an aside back where the new folder was not completed)."""
    error = ""
    try:
        work()
    except Exception as e:  # every rank raises it, below
        error = f"rank {session.rank}: {type(e).__name__}: {e}"
    errors = gather_bytes(session.ctx, error.encode())
    joined = "; ".join(e.decode() for e in errors or [] if e) if session.is_main else None
    joined = broadcast_bytes(session.ctx, joined.encode() if joined is not None else None).decode()
    if joined:
        if writer:
            recover_directories(folder.parent, SESSION_FILE)
        raise RuntimeError(f"OmniLearnTrainer: the checkpoint {folder} was not completed ({joined}); the previous "
                           "complete checkpoint is kept")


def set_aside(folder: Path) -> Path | None:
    """Before Trainer writes ``folder`` (which it does in place): what an earlier crash left is mended
    (:func:`omnilearn.commit.recover_directories`: an aside put back where its folder is not complete, else
    removed); then a complete ``folder`` (the same step saved again) is moved aside to
    ``.checkpoint-<step>.old-<pid>``, where it stays the step's checkpoint until the new one is marked, and a cut
    one is removed (Trainer writes afresh: no file of another save stays in). Returns the aside, or None."""
    recover_directories(folder.parent, SESSION_FILE)
    if complete(folder):
        aside = folder.with_name(f".{folder.name}.old-{os.getpid()}")
        os.replace(folder, aside)
        sync(folder.parent)
        return aside
    if folder.exists():
        shutil.rmtree(folder)
    return None


def drop(aside: Path | None) -> None:
    """The aside of a folder saved again, once the new one is marked (a kill before: the next save removes it)."""
    if aside is not None:
        shutil.rmtree(aside)


def arm_rescue(session: Any, saver: Callable[[int], str]) -> None:
    """Let the session's survivors save Trainer folders (:func:`rescue_trainer`); rank 0 warns once when a torchrun
    restart would fail before any of it (:func:`omnilearn.bsp.rescue.arm`: accelerate makes the process group from
    torchrun's store, which torch shares across restarts)."""
    arm(session, saver, "this Trainer")


def rescue_trainer(trainer: Any, step: int) -> str:
    """``OmniLearnTrainer``'s survivor's save: ``checkpoint-<step>`` as Trainer loads it (weights, optimizer, LR
    scheduler, trainer state; the session file last: :func:`rescue`), whatever ``should_save`` says (the writer
    Trainer would pick may be the rank that died)."""
    if trainer.state.global_step != step:
        return (f"nothing was saved: Trainer's step {trainer.state.global_step} is not the session's {step} here; "
                "a restart resumes from the last checkpoint")

    def parts(folder: Path) -> None:
        model = trainer.accelerator.unwrap_model(trainer.model, keep_torch_compile=False)
        if isinstance(model, PreTrainedModel):  # save_pretrained writes on the main process only: write its files
            model.config.save_pretrained(folder)
        safetensors.torch.save_model(model, str(folder / SAFE_WEIGHTS_NAME), metadata={"format": "pt"})
        torch.save(trainer.optimizer.state_dict(), folder / OPTIMIZER_NAME)
        if trainer.lr_scheduler is not None:
            torch.save(trainer.lr_scheduler.state_dict(), folder / SCHEDULER_NAME)
        trainer.state.save_to_json(str(folder / TRAINER_STATE_NAME))

    return rescue(trainer.session, trainer.args.output_dir, step, parts)


def rescue(session: Any, output_dir: str | Path, step: int, write_parts: Callable[[Path], object]) -> str:
    """A survivor's save after a lost peer (:mod:`omnilearn.bsp.rescue`): ``checkpoint-<step>`` written alone, no
    collective. One writer per step (an ``O_EXCL`` claim: survivors cannot talk); Trainer's parts
    (``write_parts(tmp)``: weights, optimizer, scheduler, trainer state) into ``.checkpoint-<step>.rescue-<pid>``,
    the session file last as the mark (this rank's state only), then the folder renamed into place (a cut folder
    of the same step, never complete, is replaced). Nothing is rotated. Says what it did."""
    final = Path(output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{step}"
    if complete(final):
        return f"{final} is complete already"
    final.parent.mkdir(parents=True, exist_ok=True)
    with claimed(final.with_name(f".{final.name}.claim")) as mine:
        if not mine:
            return f"{final} is saved by another survivor"
        tmp = final.with_name(f".{final.name}.rescue-{os.getpid()}")
        try:
            tmp.mkdir()
            state = to_bytes(session_state(session, rows=False))
            commit(tmp / SESSION_FILE, lambda: (write_parts(tmp), sync_tree(tmp)), lambda: state)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            sync(final.parent)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return f"saved {final}: train(resume_from_checkpoint=True) resumes there"


def sweep_survivors_leftovers(output_dir: Path) -> None:
    """What survivors killed mid-save left (an ordinary save's tidying): their stale claims, and their
    ``.checkpoint-<n>.rescue-<pid>`` folders whose process is gone (never the mark of a checkpoint: the folder is
    renamed into place only once complete)."""
    sweep_claims(output_dir)
    for p in output_dir.glob(f".{PREFIX_CHECKPOINT_DIR}-*.rescue-*"):
        pid = p.name.rsplit("-", 1)[1]
        if pid.isdigit() and start_time(int(pid)) is None:
            shutil.rmtree(p, ignore_errors=True)


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
    newer cut ones; one line when there is none. A step saved again and cut before its mark counts by its aside
    (``.checkpoint-<step>.old-<pid>``: the previous save of that step, whole). Reads only (every rank calls it)."""
    found = {n: p for n, p in committed_directories(Path(output_dir), SESSION_FILE).items() if _FOLDER.match(n)}
    names = [n for n in os.listdir(output_dir) if _FOLDER.match(n) and (Path(output_dir) / n).is_dir()] \
        if os.path.isdir(output_dir) else []
    cut = sorted((n for n in names if n not in found), key=_step, reverse=True)
    whole = sorted(found, key=_step, reverse=True)
    if not whole:
        found_text = f"only cut-short folders without {SESSION_FILE} ({', '.join(cut)})" if cut else \
            "no checkpoint folder"
        raise ConfigError(f"resume_from_checkpoint=True: {output_dir} holds {found_text}; give "
                          "resume_from_checkpoint=None to start afresh, or the path of a checkpoint OmniLearnTrainer "
                          "completed")
    newer = [n for n in cut if _step(n) > _step(whole[0])]
    if newer:
        warnings.warn(f"{', '.join(newer)} in {output_dir} lack {SESSION_FILE} (cut short mid-save): resuming "
                      f"{whole[0]}, the newest complete checkpoint", CutCheckpointWarning, stacklevel=3)
    return str(found[whole[0]])

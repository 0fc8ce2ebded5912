"""``OmniLearnStrategy``'s survivors' save: under Lightning too, a crash costs one step (:mod:`omnilearn.bsp.rescue`).

Where. Lightning's own file for a failed fit: the path of the Trainer's
``OnExceptionCheckpoint`` (else ``last.ckpt`` in the directory of a
``ModelCheckpoint(save_last=True)``), so the restart resumes it with
``trainer.fit(model, ..., ckpt_path="last")``, which looks at both. With
neither, nothing is saved and the line says what to add. Under plain DDP an
``OnExceptionCheckpoint`` cannot help with a dead peer: its save gathers and
waits at a barrier, and rank 0 alone writes (the dead one, maybe).

What. A Lightning checkpoint of the last completed optimizer step, as a
``ModelCheckpoint`` in that step's ``on_train_batch_end`` would have written
it (Lightning's own tested way back into a mid-epoch step): the model,
optimizer, LR schedulers, callbacks and hyperparameters as they are at the
failure (unchanged since: a peer's death fails the next step's gradient
all-reduce, before its optimizer step), the fit loop's progress as it stood
at that step's end (:class:`Boundary` keeps it: at the failure, Lightning's
counters are inside the next step, one or more micro-batches on, which a
resume would skip), and this rank's session state (no collective: its own
random streams, the open window's rows dropped). BatchNorm statistics are
the saver's own (no average: that is a collective).

How. No collective, no store. One writer at a time under an ``flock`` of a
hidden file beside the checkpoint, which also holds the step written and
when: a survivor skips when another wrote this step or a newer one within
the last :data:`FRESH_S` seconds (survivors can stand one step apart). The
file is written atomically (temporary file, fsync, rename): a kill during
the save leaves the previous file whole. On the survivors, the user's
``OnExceptionCheckpoint`` and Lightning's barriers after a lost peer are
skipped (their collectives would fail). A failure inside ``Session.step()``
(the model already one step on, Lightning's loop not yet at its end) saves
nothing, and says so.

Run: ``python -m pytest -q tests/faults/test_rescue_lightning.py``
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.loops.loop import _Loop
from lightning.pytorch.loops.progress import _BaseProgress

from omnilearn.bsp.checkpointing import session_state
from omnilearn.distributed.lost import peer_lost
from omnilearn.observe.rundir import write_atomic

FRESH_S = 120.0  # a step another survivor wrote this recently is this failure's (an older one: an earlier failure)
HOW = ('add Lightning\'s OnExceptionCheckpoint(dirpath=...) (or ModelCheckpoint(dirpath=..., save_last=True)) to the '
       'Trainer and resume with trainer.fit(..., ckpt_path="last")')


def target(trainer: Any) -> Path | None:
    """Where a survivor saves: the first ``OnExceptionCheckpoint``'s path, else ``last.ckpt`` of the first
    ``ModelCheckpoint(save_last=True)`` with a directory; None: neither."""
    for callback in trainer.callbacks:
        if isinstance(callback, OnExceptionCheckpoint):
            return Path(callback.ckpt_path)
    for callback in trainer.callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.save_last and callback.dirpath:
            return Path(callback.dirpath) / f"{callback.CHECKPOINT_NAME_LAST}{callback.FILE_EXTENSION}"
    return None


def lock_of(path: Path) -> Path:
    """The file survivors hold (``flock``) while one of them writes ``path``, recording the step it holds."""
    return path.with_name(f".{path.name}.omnilearn")


def sweep_lock(trainer: Any) -> None:
    """Remove the survivors' lock file beside the checkpoint they write (a completed fit: an earlier attempt's
    survivors have long exited; it stayed behind after every failure)."""
    path = target(trainer)
    if path is not None:
        lock_of(path).unlink(missing_ok=True)


class SurvivorSave:
    """``OmniLearnStrategy``'s side of it (a mixin before ``DDPStrategy``): the save on a lost peer, and the
    barriers and checkpoint saves a survivor skips after it."""

    session: Any
    boundary: "Boundary"

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not self._peer_lost():
            super().barrier(*args, **kwargs)

    def on_exception(self, exception: BaseException) -> None:
        if self.session is not None and peer_lost(exception):
            self.session._lost(exception)  # once: this survivor saves the last step
        super().on_exception(exception)

    def _peer_lost(self) -> bool:
        """A peer is gone: this rank saved (or saves now, for the error being handled), and skips collectives."""
        if self.session is None:
            return False
        error = sys.exc_info()[1]
        if self.session.rescued is None and error is not None and peer_lost(error):
            self.session._lost(error)
        return self.session.rescued is not None

    def _rescue(self, step: int, key: str) -> str:
        return rescue(self, step, time.time(), key)

    def _shield_sigterm(self) -> None:
        """At train start (after Lightning installed its handlers), in a run of several ranks: Lightning's SIGTERM
        handler wrapped in :class:`PeerSafe`."""
        handler = signal.getsignal(signal.SIGTERM)
        if (self.world_size > 1 and threading.current_thread() is threading.main_thread() and callable(handler)
                and not isinstance(handler, PeerSafe)):
            signal.signal(signal.SIGTERM, PeerSafe(handler))


class PeerSafe:
    """A SIGTERM handler that cannot raise a lost peer's error into the step. Lightning's broadcasts from inside
    the handler (a collective); once a peer is gone it raises wherever the main thread is, mid optimizer step
    too, and a survivor would save a half-updated model. Here that error is dropped: the next collective fails
    in its place, where the survivors' save knows the state (torchrun's agent sends SIGTERM when a worker dies,
    often while a survivor saves). Any other error of the handler is raised as before."""

    def __init__(self, handler) -> None:
        self.handler = handler

    def __call__(self, signum, frame) -> None:
        try:
            self.handler(signum, frame)
        except Exception as e:
            if not peer_lost(e):
                raise


class Boundary:
    """The fit loop's progress at the end of the last optimizer step (its ``on_train_batch_end``), with the step.

    Kept cheaply every step (the counters of the loop tree's progress objects, found once per fit, and the epoch
    loop's ``_batches_that_stepped``: about a fifth of ``fit_loop.state_dict()``'s 80 us); :meth:`loop_state`
    puts them back for the moment it takes ``fit_loop.state_dict()`` at the failure.
    """

    def __init__(self) -> None:
        self.step: int | None = None
        self._objects: list | None = None
        self._values: tuple | None = None

    def track(self, trainer: Any, world_size: int) -> bool:
        """At train start: whether a survivor can save (several ranks, a :func:`target`); then the progress objects
        ``fit_loop.state_dict()`` reads (as ``_Loop.state_dict`` walks), marked at each step's end."""
        self.step = None
        if world_size < 2 or target(trainer) is None:
            return False
        self._objects = _progress(trainer.fit_loop)
        return True

    def mark(self, trainer: Any, step: int) -> None:
        self.step, self._values = step, self._now(trainer)

    def loop_state(self, trainer: Any) -> dict:
        """``trainer.fit_loop.state_dict()`` as it was at the mark."""
        now = self._now(trainer)
        self._put(trainer, self._values)
        try:
            return trainer.fit_loop.state_dict()
        finally:
            self._put(trainer, now)

    def _now(self, trainer: Any) -> tuple:
        return [_snap(p) for p in self._objects], trainer.fit_loop.epoch_loop._batches_that_stepped

    def _put(self, trainer: Any, values: tuple) -> None:
        for p, v in zip(self._objects, values[0]):
            _restore(p, v)
        trainer.fit_loop.epoch_loop._batches_that_stepped = values[1]


def _progress(loop: Any) -> list:
    found = []
    for value in vars(loop).values():
        if isinstance(value, _BaseProgress):
            found.append(value)
        elif isinstance(value, _Loop):
            found += _progress(value)
    return found


def _snap(progress: Any) -> tuple:
    return tuple(_snap(v) if isinstance(v, _BaseProgress) else v for v in vars(progress).values())


def _restore(progress: Any, values: tuple) -> None:
    for (name, value), saved in zip(list(vars(progress).items()), values):
        if isinstance(value, _BaseProgress):
            _restore(value, saved)
        else:
            setattr(progress, name, saved)


def rescue(strategy: Any, step: int, seen: float, key: str) -> str:
    """Write the Lightning checkpoint of ``step`` (the session's last completed step) alone; say what was done."""
    trainer = strategy.lightning_module.trainer
    path = target(trainer)
    if path is None:
        return f"nothing was saved: the Trainer has no checkpoint for a failed fit; {HOW}"
    boundary = strategy.boundary
    if boundary.step != step or trainer.global_step != step:
        return (f"nothing was saved: Lightning's loop was not at the end of step {step} (its last step end: "
                f"{boundary.step}, global_step {trainer.global_step}); a restart resumes from the last checkpoint")
    checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
    checkpoint["loops"]["fit_loop"] = boundary.loop_state(trainer)
    checkpoint[key] = session_state(strategy.session, rows=False)
    return write_newest(path, step, seen, lambda f: torch.save(checkpoint, f))


def write_newest(path: Path, step: int, seen: float, write, resumes: str = 'trainer.fit(..., ckpt_path="last")') -> str:
    """``write`` into ``path`` atomically unless another survivor holds this step or a newer one (module docstring);
    ``resumes``: what resumes it, for the line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_of(path), "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        held.seek(0)
        try:
            last = json.loads(held.read() or "{}")
        except ValueError:  # cut by a kill mid-write: nothing held
            last = {}
        if last.get("step", -1) >= step and last.get("at", 0.0) > seen - FRESH_S:
            return f"{path} holds step {last['step']}, saved by another survivor"
        write_atomic(path, write)
        held.seek(0)
        held.truncate()
        held.write(json.dumps({"step": step, "at": time.time(), "pid": os.getpid()}))
        held.flush()
    return f"saved the Lightning checkpoint of step {step} in {time.time() - seen:.2f} s to {path}: {resumes} resumes there"

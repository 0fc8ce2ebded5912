"""Checkpoints of a TensorFlow run: the model and optimizer by ``tf.train.Checkpoint``, the session's state beside them.

One directory per checkpoint, committed by a rename::

    CHECKPOINTS/step-000000040/model.index, model.data-*   tf.train.Checkpoint(model=..., optimizer=...).write
    CHECKPOINTS/step-000000040/session.json                 step, split, controller, record counters, training time

Who writes what. Every worker calls :meth:`Checkpoints.save` at the same
step (a control-interval end, so no step's timings are in flight), because
saving a Keras model under ``MultiWorkerMirroredStrategy`` may read
variables that all-reduce on read: worker 0 writes into
``.step-N.tmp-<pid>/``, adds ``session.json`` and renames the directory into
place (a crash leaves a temporary directory, swept at the next save, never
a half checkpoint); the other workers write into a temporary directory of
their own and delete it (TensorFlow's documented pattern). The newest
``keep`` are kept.

Resuming (:meth:`Checkpoints.restore`, every worker, once the model and the
data are known): each worker reads the newest committed checkpoint from the
same directory (several machines: storage they all see); one gather checks
that they all found the same step. At the same worker count the split,
the controller and its windows carry on, so the run goes on as if never
stopped; at another count (elastic) the data position, step count and
training time carry on and the split starts afresh from the declared speeds,
as in the PyTorch runtime (:func:`omnilearn.bsp.checkpointing.load_session_state`).
Every step's samples depend on neither, so the weights follow the same path.

Run: ``python -m pytest -q tests/tf/test_tf_resume.py``
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import tensorflow as tf

from omnilearn.config import ConfigError
from omnilearn.observe.rundir import write_atomic

FORMAT = 1
STATE = "session.json"
_DIR = re.compile(r"^step-(\d{9,})$")


class Checkpoints:
    """The checkpoints of one session in ``directory``: one every ``every`` steps (at interval ends), ``keep`` kept."""

    def __init__(self, session, directory: str | Path, every: int = 0, keep: int = 3) -> None:
        if type(every) is not int or every < 0:
            raise ConfigError(f"checkpoint_every={every!r} must be a whole number of steps (0: only at a stop)")
        if type(keep) is not int or keep < 1:
            raise ConfigError(f"keep_checkpoints={keep!r} must be at least 1")
        self.session, self.directory, self.every, self.keep = session, Path(directory), every, keep
        self.next_due: int | None = None

    def steps(self) -> list[int]:
        """The committed checkpoints' steps, oldest first."""
        if not self.directory.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.directory.iterdir()
                      if (m := _DIR.match(p.name)) and (p / STATE).is_file())

    def path(self, step: int) -> Path:
        return self.directory / f"step-{step:09d}"

    def due(self) -> bool:
        """A checkpoint is due at this interval end (every ``every`` steps), or a stop was agreed on."""
        s = self.session
        if self.next_due is None:
            self.next_due = (s.next_step // self.every + 1) * self.every if self.every else None
        return s.should_stop or (self.next_due is not None and s.next_step >= self.next_due)

    def save(self) -> Path | None:
        """Every worker, at the same interval end: worker 0 commits ``step-<next step>``; its path (None elsewhere)."""
        s = self.session
        start = time.perf_counter()
        saver = tf.train.Checkpoint(model=s.model, optimizer=s.optimizer)
        if self.every:
            self.next_due = (s.next_step // self.every + 1) * self.every
        if not s.is_main:
            scratch = tempfile.mkdtemp(prefix="omnilearn-tf-ckpt-")
            try:
                saver.write(os.path.join(scratch, "model"))
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
            return None
        self.directory.mkdir(parents=True, exist_ok=True)
        self.sweep()
        final = self.path(s.next_step)
        tmp = self.directory / f".{final.name}.tmp-{os.getpid()}"
        saver.write(str(tmp / "model"))
        state = json.dumps(session_state(s), default=float).encode()
        write_atomic(tmp / STATE, lambda f: f.write(state))
        if final.exists():  # the same step saved again (a resumed run stopped where it started)
            shutil.rmtree(final)
        os.replace(tmp, final)
        self.prune()
        if s.telemetry is not None:
            size = sum(p.stat().st_size for p in final.iterdir())
            s.telemetry.checkpoint(s.next_step, size, time.perf_counter() - start)
        return final

    def sweep(self) -> None:
        """Remove the temporary directories of saves that never committed (a crash mid-save)."""
        for p in self.directory.glob(".step-*.tmp-*"):
            shutil.rmtree(p, ignore_errors=True)

    def prune(self) -> None:
        for step in self.steps()[: -self.keep]:
            shutil.rmtree(self.path(step), ignore_errors=True)

    def restore(self) -> bool:
        """Every worker: load the newest checkpoint into the model, optimizer and session (False: none yet)."""
        s = self.session
        steps = self.steps()
        newest = steps[-1] if steps else -1
        seen = {int(v) for v in s.gather([newest])[:, 0]}
        if len(seen) > 1:
            raise ConfigError(f"the workers found different newest checkpoints in {self.directory} (steps "
                              f"{sorted(seen)}): checkpoints of several machines need storage they all see")
        if newest < 0:
            return False
        start = time.perf_counter()
        path = self.path(newest)
        try:
            state = json.loads((path / STATE).read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"checkpoint {path / STATE} cannot be read ({e}); move it aside to resume from the one "
                              "before") from None
        if s.model is not None and not s.model.built:
            raise ConfigError("resuming needs the model's variables: build the model (keras.Input first) in "
                              "ol.scope() before wrap()")
        if not s.optimizer.built:  # Keras builds its slots at the first step; a checkpoint holds them already
            with s.strategy.scope():
                s.optimizer.build(s.model.trainable_variables)
        tf.train.Checkpoint(model=s.model, optimizer=s.optimizer).read(str(path / "model")).expect_partial()
        load_session_state(s, state)
        if s.telemetry is not None:
            s.telemetry.loaded(time.perf_counter() - start)
        return True


def session_state(s) -> dict[str, Any]:
    """What the session needs to go on exactly (taken at an interval end: no step rows in flight)."""
    return {"format": FORMAT, "world_size": s.world_size, "global_batch": s.global_batch,
            "steps_done": s.steps_done, "next_step": s.next_step, "train_s": s.clock.at_last_step_s,
            "loop": s.loop.state_dict(), "schedule": s.schedule.state_dict(),
            "telemetry": s.telemetry.state_dict() if s.telemetry is not None else {}}


def load_session_state(s, state: dict[str, Any]) -> None:
    """Restore :func:`session_state`: all of it at the same worker count; at another, what does not depend on it."""
    if state.get("format") != FORMAT:
        raise ConfigError(f"checkpoint session state format {state.get('format')!r}; this version reads {FORMAT}")
    if state["global_batch"] != s.global_batch:
        raise ConfigError(f"the checkpoint's global batch is {state['global_batch']}, this run's {s.global_batch}: "
                          f"resume with global_batch={state['global_batch']}")
    if int(state["world_size"]) == s.world_size:
        s.loop.load_state_dict(state["loop"])
        s.schedule.load_state_dict(state["schedule"])
    s.steps_done, s.next_step = int(state["steps_done"]), int(state["next_step"])
    s.clock.restore(float(state["train_s"]))
    if s.telemetry is not None:
        s.telemetry.resume(state.get("telemetry", {}), s.next_step, int(state["world_size"]))

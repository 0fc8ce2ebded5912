"""Checkpoints of a TensorFlow run: the model and optimizer by ``tf.train.Checkpoint``, the session's state beside them.

One directory per checkpoint, committed by a rename::

    CHECKPOINTS/step-000000040/model.index, model.data-*   tf.train.Checkpoint(model=..., optimizer=...).write
    CHECKPOINTS/step-000000040/session.json                 step, split, controller, record counters, training time,
                                                            the shapes of the model's and optimizer's variables

Who writes what. Every worker calls :meth:`Checkpoints.save` at the same
step (a control-interval end, so no step's timings are in flight), because
saving a Keras model under ``MultiWorkerMirroredStrategy`` may read
variables that all-reduce on read: worker 0 commits the directory by the
one save sequence of every door (:func:`omnilearn.commit.commit_directory`:
the model files into ``.step-N.tmp-<pid>/``, fsynced, ``session.json`` last
as the commit mark, the directory renamed into place); the other workers
write into a temporary directory of their own and delete it (TensorFlow's
documented pattern). Complete or absent: a step saved again (a resumed run
stopped where it started) first moves the old one aside
(``.step-N.old-<pid>``), renames the new one in, then removes the aside; a
crash between leaves the aside, which counts as that step's checkpoint and
is put back at the next save; temporary directories are swept then. The
newest ``keep`` are kept, older ones removed only after the new one is
committed.

One outcome: after its write every worker joins one gather of "did my
write fail" (and the ``errno``); if one did, every worker raises
:class:`CheckpointFailed` naming it: no peer waits for the timeout.

Resuming (:meth:`Checkpoints.restore`, every worker, once the model and the
data are known): each worker reads the newest committed checkpoint from the
same directory (several machines: storage they all see); one gather checks
that they all found the same step. At the same worker count the split,
the controller and its windows carry on, so the run goes on as if never
stopped; at another count (elastic) the data position, step count and
training time carry on and the split starts afresh from the declared speeds,
as in the PyTorch runtime (:func:`omnilearn.bsp.checkpointing.load_session_state`).
Every step's samples depend on neither, so the weights follow the same path.

A changed model or optimizer is refused, naming where it differs, before
anything is read (:mod:`omnilearn.tf.changed`); TensorFlow's own check
(every variable bound to a saved value) runs after the read. So is data the
saved position would read differently (another seed, data size or global
batch: :func:`check_resume`, by :mod:`omnilearn.data.position` as in the
PyTorch runtime); a checkpoint from before that was saved warns.

A checkpoint is due at the first interval end at or after each multiple of
``every`` (:meth:`Checkpoints.due`, as ``omnilearn train``'s trainer).

Run: ``python -m pytest -q tests/tf/test_tf_commit.py tests/tf/test_tf_trust.py tests/tf/test_tf_train.py``
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import tensorflow as tf

from omnilearn.commit import commit_directory, committed_directories
from omnilearn.config import ConfigError
from omnilearn.data.position import UnverifiedResumeWarning, basis, keyword, mismatch
from omnilearn.decisions import MAX_STRETCH
from omnilearn.tf.changed import refuse_changed, shapes

FORMAT = 1
STATE = "session.json"
_DIR = re.compile(r"^step-(\d{9,})$")


class CheckpointFailed(RuntimeError):
    """A worker's checkpoint write failed; raised on every worker alike, naming it."""


class Checkpoints:
    """The checkpoints of one session in ``directory``: one every ``every`` steps (at interval ends), ``keep`` kept."""

    def __init__(self, session, directory: str | Path, every: int = 0, keep: int = 3) -> None:
        if type(every) is not int or every < 0:
            raise ConfigError(f"checkpoint_every={every!r} must be a whole number of steps (0: only at a stop)")
        if type(keep) is not int or keep < 1:
            raise ConfigError(f"keep_checkpoints={keep!r} must be at least 1")
        self.session, self.directory, self.every, self.keep = session, Path(directory), every, keep
        self.next_due = self.due_after(session.next_step)

    def steps(self) -> list[int]:
        """The committed checkpoints' steps, oldest first."""
        return sorted(self.found())

    def found(self) -> dict[int, Path]:
        """Each committed step's directory: ``step-N``, or its aside where a crash left only that."""
        found = committed_directories(self.directory, STATE)
        return {int(m.group(1)): p for name, p in found.items() if (m := _DIR.match(name))}

    def path(self, step: int) -> Path:
        return self.directory / f"step-{step:09d}"

    def due_after(self, step: int) -> int | None:
        """The step count at or after which the next checkpoint is due, counted from ``step`` (the start, a
        resumed step, the last save): the next multiple of ``every``, as in ``omnilearn train``'s trainer."""
        return (step // self.every + 1) * self.every if self.every else None

    def due(self) -> bool:
        """A checkpoint is due at this interval end (the first at or after each multiple of ``every`` steps), or a
        stop was agreed on."""
        s = self.session
        return s.should_stop or (self.next_due is not None and s.next_step >= self.next_due)

    def save(self) -> Path | None:
        """Every worker, at the same interval end: worker 0 commits ``step-<next step>``; its path (None elsewhere).

        Every worker learns whether every write succeeded (one gather); if one failed, every worker raises
        :class:`CheckpointFailed` naming it.
        """
        s = self.session
        start = time.perf_counter()
        self.next_due = self.due_after(s.next_step)
        final = self.path(s.next_step)
        try:
            self.write(final) if s.is_main else self.write_scratch()
            failure = None
        except Exception as e:  # told to every worker below, then raised there too
            failure = e
        self.agree(final, failure)
        if not s.is_main:
            return None
        if s.telemetry is not None:
            size = sum(p.stat().st_size for p in final.iterdir())
            s.telemetry.checkpoint(s.next_step, size, time.perf_counter() - start)
        return final

    def saver(self) -> tf.train.Checkpoint:
        return tf.train.Checkpoint(model=self.session.model, optimizer=self.session.optimizer)

    def write_scratch(self) -> None:
        """A worker other than 0: the same write (it may read variables collectively) into a scratch directory."""
        scratch = tempfile.mkdtemp(prefix="omnilearn-tf-ckpt-")
        try:
            self.saver().write(os.path.join(scratch, "model"))
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def write(self, final: Path) -> None:
        """Worker 0: the model files, then ``session.json`` (the mark), committed by a rename; then the pruning
        (:func:`omnilearn.commit.commit_directory`)."""
        commit_directory(final, lambda tmp: self.saver().write(str(tmp / "model")), STATE,
                         lambda: json.dumps(session_state(self.session), default=float).encode(), self.prune)

    def agree(self, final: Path, failure: Exception | None) -> None:
        """One gather of every worker's outcome; :class:`CheckpointFailed` on every worker if any write failed."""
        s = self.session
        code = errno_of(failure) if failure is not None else 0
        table = s.gather([1.0 if failure is not None else 0.0, float(code)])
        failed = [r for r in range(s.world_size) if table[r, 0] > 0]
        if not failed:
            return
        rank, code = failed[0], int(table[failed[0], 1])
        cause = f"{os.strerror(code)} (errno {code})" if code else "see its log"
        said = f"worker {rank} could not write checkpoint {final} ({cause})"
        if failure is not None and rank == s.rank:
            said += f": {type(failure).__name__}: {first_line(failure)}"
        raise CheckpointFailed(f"{said}; every worker stops (resume from the newest checkpoint once it is mended)")

    def prune(self) -> None:
        found = self.found()
        for step in sorted(found)[: -self.keep]:
            shutil.rmtree(found[step], ignore_errors=True)

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
        path = self.found()[newest]
        try:
            state = json.loads((path / STATE).read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"checkpoint {path / STATE} cannot be read ({e}); move it aside to resume from the one "
                              "before") from None
        check_resume(s, state)
        if s.model is not None and not s.model.built:
            raise ConfigError("resuming needs the model's variables: build the model (keras.Input first) in "
                              "ol.scope() before wrap()")
        if not s.optimizer.built:  # Keras builds its slots at the first step; a checkpoint holds them already
            with s.strategy.scope():
                s.optimizer.build(s.model.trainable_variables)
        refuse_changed(path, state, s.model, s.optimizer)
        status = self.saver().read(str(path / "model")).expect_partial()  # objects saved but unused: Keras' own
        try:
            status.assert_existing_objects_matched()
        except AssertionError as e:
            raise ConfigError(f"checkpoint {path} does not hold every variable of this model and optimizer "
                              f"({first_line(e)}): resume with the model and optimizer it was saved from") from None
        load_session_state(s, state)
        self.next_due = self.due_after(s.next_step)
        if s.telemetry is not None:
            s.telemetry.loaded(time.perf_counter() - start)
        return True


def session_state(s) -> dict[str, Any]:
    """What the session needs to go on exactly (taken at an interval end: no step rows in flight)."""
    return {"format": FORMAT, "world_size": s.world_size, "global_batch": s.global_batch,
            "data": basis(s.plan), "steps_done": s.steps_done, "next_step": s.next_step,
            "train_s": s.clock.at_last_step_s,
            "loop": s.loop.state_dict(), "schedule": s.schedule.state_dict(), "checks": s.checks_on,
            "stretch": s.window_steps // s.cfg.control_interval, "intervals": s.intervals,
            "telemetry": s.telemetry.state_dict() if s.telemetry is not None else {},
            "epoch_begun": getattr(s, "epoch_begun", None),
            "variables": {"model": shapes(s.model.weights), "optimizer": shapes(s.optimizer.variables)}}


def errno_of(e: BaseException) -> int:
    """The ``errno`` of the ``OSError`` behind ``e`` (itself, or one it was raised from), else 0."""
    for _ in range(8):
        if e is None:
            return 0
        if isinstance(e, OSError) and e.errno:
            return e.errno
        e = e.__cause__ or e.__context__
    return 0


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def check_resume(s, state: dict[str, Any]) -> None:
    """Refuse, before anything is read, a state this session would read differently: another format, global batch
    or data basis (seed, data size, steps per epoch: :mod:`omnilearn.data.position`), in one line naming the
    ``omnilearn.tf.setup`` keyword and the CLI flag. A state from before the basis was saved: a warning."""
    if state.get("format") != FORMAT:
        raise ConfigError(f"checkpoint session state format {state.get('format')!r}; this version reads {FORMAT}")
    if state["global_batch"] != s.global_batch:
        raise ConfigError(tf_wording(f"the checkpoint was saved with global batch {state['global_batch']} but this "
                                     f"run has {s.global_batch}: resume with "
                                     f"{keyword('global_batch', state['global_batch'])}"))
    if "data" not in state:
        warnings.warn("the checkpoint's session state predates the data checks (seed, data size, steps per epoch): "
                      "the resume cannot check them; use the seed and data it was saved with",
                      UnverifiedResumeWarning, stacklevel=4)
        return
    problem = mismatch(state["data"], basis(s.plan))
    if problem is not None:
        raise ConfigError(tf_wording(problem))


def tf_wording(message: str) -> str:
    """:func:`omnilearn.data.position.keyword`'s fix in this door's words: the ``omnilearn.tf.setup`` keyword."""
    return message.replace("omnilearn.setup keyword", "omnilearn.tf.setup keyword")


def load_session_state(s, state: dict[str, Any]) -> None:
    """Restore :func:`session_state` (checked by :func:`check_resume`): all of it at the same worker count; at
    another, what does not depend on it."""
    if int(state["world_size"]) == s.world_size:
        s.loop.load_state_dict(state["loop"])
        s.schedule.load_state_dict(state["schedule"])
        s.checks_on = bool(state.get("checks", True))  # as the last interval left it (older states: on)
        s.intervals = int(state.get("intervals", 0))  # the stretch's warm-up goes on (elastic: afresh)
        if s.cfg.min_window_s > 0:  # as the last interval stretched it (older states: not stretched)
            s.window_steps = s.cfg.control_interval * min(int(state.get("stretch", 1)), MAX_STRETCH)
    s.steps_done, s.next_step = int(state["steps_done"]), int(state["next_step"])
    s.epoch_begun = state.get("epoch_begun")  # ol.fit: whether the resumed epoch's callbacks began it already
    s.clock.restore(float(state["train_s"]))
    if s.telemetry is not None:
        s.telemetry.resume(state.get("telemetry", {}), s.next_step, int(state["world_size"]))

"""A crash costs one step in the TensorFlow runtime too: a survivor saves the last completed step, alone.

The PyTorch runtime's argument (:mod:`omnilearn.bsp.rescue`) holds here. Under
``MultiWorkerMirroredStrategy`` every worker holds the whole model and
optimizer, equal after every step. A worker that dies makes its peers' next
collective abort within milliseconds (``UnavailableError: ... Collective ops
is aborted by: recvmsg:Connection reset by peer``, :mod:`omnilearn.distributed.lost`).
The step's gradients travel in one all-reduce before any variable is
updated (:mod:`omnilearn.tf.steps`), so a step whose all-reduce aborted
changed nothing, and a window's gather that aborted comes after a counted
step. Either way the survivor holds step ``next_step``'s state exactly.

Who writes what: any survivor, with no collective, into the run's checkpoint
directory (``checkpoint_to`` / ``setup(out=, checkpoint_every=)`` /
``omnilearn launch --checkpoint-every`` / ``BackupAndRestore``), as an ordinary
``step-<N>/`` (:mod:`omnilearn.tf.checkpointing`): the model and optimizer by
``tf.train.Checkpoint`` (their mirrored variables read locally), then
``session.json`` as the commit mark, the directory renamed into place. One
writer per step (an ``O_EXCL`` claim: survivors cannot talk), nothing
pruned; the open window's rows are not saved (the restart starts a window
there). A restart (``--max-restarts``, ``--resume``) loads the newest
committed step at any worker count, so it resumes there. A run with no
checkpoint directory says that nothing was saved and what gives one.

Run: ``python -m pytest -q tests/tf/test_tf_train.py tests/tf/test_tf_launch.py``
"""

from __future__ import annotations

import json
import sys
import time

from omnilearn.commit import claimed, commit_directory
from omnilearn.distributed.lost import first_line, lost_cause, why_lost
from omnilearn.tf.checkpointing import STATE, session_state

NOTHING = ("nothing was saved: the run has no checkpoint directory (setup(out=..., checkpoint_every=N), "
           "omnilearn launch --checkpoint-every N, or fit(callbacks=[BackupAndRestore(dir)]) gives one); a restart "
           "resumes from the last checkpoint")


def lost(session, error: BaseException) -> None:
    """``error`` ended this worker's step: if a peer is gone, save the last completed step, once, and say so."""
    cause = lost_cause(error)
    if cause is None or session.rescued is not None:
        return
    seen = time.time()
    try:
        said = save(session, seen)
    except Exception as e:  # the run is failing already: say why nothing was saved
        said = f"the save failed ({type(e).__name__}: {first_line(e)}); a restart resumes from the last checkpoint"
    session.rescued = (f"omnilearn: worker {session.rank} lost a peer at step {session.next_step} "
                       f"({why_lost(cause)}); {said}")
    print(session.rescued, file=sys.stderr, flush=True)


def iterations_mark(session) -> tuple[int, int]:
    """``(steps done, the optimizer's iterations)`` now (a local read; at the first step and each interval end)."""
    return session.steps_done, int(session.optimizer.iterations.numpy())


def undo_aborted_increment(session) -> None:
    """The step whose all-reduce aborted updated no weight, but the optimizer's ``iterations.assign_add(1)``, which
    does not wait for the all-reduce, may have run (measured: 19 after 18 steps): put back the count of the steps
    done (one per step since the last mark), as the uninterrupted run has it at this step."""
    mark = session.iterations_at
    if mark is None:
        return
    expected = mark[1] + session.steps_done - mark[0]
    if int(session.optimizer.iterations.numpy()) == expected + 1:
        session.optimizer.iterations.assign(expected)


def save(session, seen: float) -> str:
    checkpoints = session.checkpoints
    if checkpoints is None or session.model is None:
        return NOTHING
    undo_aborted_increment(session)
    step = session.next_step
    final = checkpoints.path(step)
    if (final / STATE).is_file():
        return f"{final} is complete already"
    final.parent.mkdir(parents=True, exist_ok=True)
    with claimed(final.with_name(f".{final.name}.claim")) as mine:
        if not mine:
            return f"{final} is saved by another survivor"
        state = session_state(session)
        if state["telemetry"]:  # the record's count: every step trained, the open window's too (its rows are not)
            state["telemetry"]["steps"] = step
        state["rescue"] = {"worker": session.rank, "seen_at": seen}
        commit_directory(final, lambda tmp: checkpoints.saver().write(str(tmp / "model")), STATE,
                         lambda: json.dumps(state, default=float).encode())
    return f"saved the checkpoint of step {step} in {time.time() - seen:.2f} s to {final}: a restart resumes there"

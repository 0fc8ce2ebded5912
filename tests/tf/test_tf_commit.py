"""A TensorFlow checkpoint is complete or absent: a crash at any point of its commit leaves one a restore reads.

In this process, :class:`omnilearn.tf.checkpointing.Checkpoints` of a stand-in session (a ``tf.Module`` for the
model and the optimizer, its state a step number). The crash: right after the k-th rename or removal of a save
(``os.replace``, ``shutil.rmtree``), the process "dies": that call and every later one raise. For every k, the
directory then restores (a fresh session reads the old checkpoint or the new one, whole), and the next save
leaves no aside nor temporary directory behind. Cases: a step saved again (a resumed run stopped where it
started: the old one must not be removed before the new one is in) and the next step with ``keep=1`` (the old
one pruned only after).

Run: ``python -m pytest -q tests/tf/test_tf_commit.py``
"""

from __future__ import annotations

import numpy as np
import pytest

from crashes import Crash, Ops
from needs import needs

pytestmark = needs("tensorflow", "tensorflow")


def session(value: float, step: int):
    import tensorflow as tf

    class Part(tf.Module):
        def __init__(self, v: float) -> None:
            super().__init__()
            self.v, self.built = tf.Variable([v]), True

        @property
        def weights(self):
            return [self.v]

    class Session:
        model, optimizer = Part(value), Part(-value)
        is_main, rank, world_size, telemetry, next_step, should_stop = True, 0, 1, None, step, False
        loaded = None

        @staticmethod
        def gather(row):
            return np.array([list(row)], dtype=float)

    return Session()


@pytest.fixture
def checkpoints(monkeypatch):
    from omnilearn.tf import checkpointing

    monkeypatch.setattr(checkpointing, "session_state", lambda s: {"format": 1, "next_step": s.next_step})
    monkeypatch.setattr(checkpointing, "check_resume", lambda s, state: None)
    monkeypatch.setattr(checkpointing, "load_session_state", lambda s, state: setattr(s, "loaded", state["next_step"]))
    return lambda s, directory, keep, every=0: checkpointing.Checkpoints(s, directory, every, keep)


@pytest.mark.parametrize("second_step, keep", [(10, 3), (20, 1)], ids=["same-step-again", "next-step-keep-1"])
def test_a_crash_anywhere_in_the_commit_leaves_a_checkpoint_to_resume_from(checkpoints, tmp_path, second_step, keep):
    crash_after = 0
    while True:
        directory = tmp_path / f"crash-{crash_after}"
        checkpoints(session(1.0, 10), directory, keep).save()
        try:
            with Ops(crash_after):
                checkpoints(session(2.0, second_step), directory, keep).save()
            finished = True
        except Crash:
            finished = False
        fresh = session(0.0, 0)
        assert checkpoints(fresh, directory, keep).restore(), f"crash after call {crash_after}: no checkpoint left"
        value = float(fresh.model.v.numpy()[0])
        assert (fresh.loaded, value) in {(10, 1.0), (second_step, 2.0)}, (crash_after, fresh.loaded, value)
        assert float(fresh.optimizer.v.numpy()[0]) == -value
        checkpoints(session(3.0, 30), directory, keep).save()  # the next save mends what the crash left
        left = sorted(p.name for p in directory.iterdir())
        assert not [n for n in left if n.startswith(".")] and "step-000000030" in left, (crash_after, left)
        if finished:
            break
        crash_after += 1
    assert crash_after >= 2  # the crash hit the commit's own steps, not only the writes before it


@pytest.mark.parametrize("interval, every, saved", [(4, 4, [4, 8, 12, 16]), (4, 3, [4, 8, 12, 16]), (3, 4, [6, 9, 12])])
def test_checkpoint_every_n_saves_at_the_first_interval_end_at_or_after_n_2n(checkpoints, tmp_path, interval, every,
                                                                             saved):
    """As ``omnilearn train``'s trainer: the first at or after N, not after 2N (the first due step was once set at
    the first interval end, so ``checkpoint_every=N`` with an interval of N saved first at 2N)."""
    s = session(1.0, 0)
    ckpts = checkpoints(s, tmp_path, 10, every)
    for s.next_step in range(interval, 17, interval):  # the interval ends
        if ckpts.due():
            ckpts.save()
    assert ckpts.steps() == saved

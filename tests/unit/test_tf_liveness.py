"""``omnilearn.tf.liveness`` without TensorFlow: who fell silent, who is not listening, the join verdict's line.

The real-process checks (a SIGSTOPped worker named by the launcher, a worker that never joins named by its
peer) are ``tests/tf/test_tf_faults.py`` and ``tests/tf/test_tf_launch.py``.

Run: ``python -m pytest -q tests/unit/test_tf_liveness.py``
"""

from __future__ import annotations

import os
import socket

from omnilearn.tf.liveness import absent, beat_path, silent, verdict


def test_a_worker_is_silent_only_after_it_beat_once_and_then_stopped(tmp_path):
    for rank, age in ((0, 1.0), (1, 9.0)):
        beat_path(tmp_path, rank).touch()
        os.utime(beat_path(tmp_path, rank), (1000.0 - age, 1000.0 - age))
    # rank 2 never beat (still joining: the join deadline is its own), rank 1 beat 9 s ago
    assert silent(tmp_path, [0, 1, 2], heartbeat_s=5.0, now=1000.0) == [(1, 9.0)]
    assert silent(tmp_path, [0, 2], heartbeat_s=5.0, now=1000.0) == []  # an exited worker is not asked about
    assert silent(tmp_path, [0, 1], heartbeat_s=10.0, now=1000.0) == []


def test_the_join_verdict_names_the_workers_whose_port_does_not_answer():
    listening = socket.socket()
    listening.bind(("localhost", 0))
    listening.listen()
    closed = socket.socket()
    closed.bind(("localhost", 0))
    free = closed.getsockname()[1]
    closed.close()  # nobody listens there now
    try:
        workers = (f"localhost:{listening.getsockname()[1]}", "localhost:1", f"localhost:{free}")
        assert absent(workers, rank=0) == [(1, "localhost:1"), (2, f"localhost:{free}")]
        line = verdict(workers, 0, 6.0)
        assert line == (f"worker 0: worker 1 (localhost:1), worker 2 (localhost:{free}) did not join the TensorFlow "
                        "cluster within 6 s; start each with its TF_CONFIG (task index 1, 2), or raise timeout_s")
        assert verdict(workers[:1] + (workers[0],), 1, 6.0).startswith(
            "worker 1: the TensorFlow cluster did not form within 6 s though every worker's port answers")
    finally:
        listening.close()

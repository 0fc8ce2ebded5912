"""Is every TensorFlow worker there? A join deadline naming the missing worker, and heartbeats the launcher watches.

- **Joining** (:class:`JoinDeadline`, beside every worker while
  ``MultiWorkerMirroredStrategy`` waits for the whole ``TF_CONFIG`` cluster):
  if the cluster has not formed within ``timeout_s``, a watcher process
  probes each peer's ``host:port`` (a TCP connect: a worker that reached
  ``omnilearn.tf.setup()`` listens there), writes one line naming those that
  do not answer and ends the worker. TensorFlow itself would wait far longer
  and name nobody. Works for local and hand-started clusters alike.
- **Heartbeats** (:func:`start_beats`, in a worker started by ``omnilearn
  train --framework tensorflow`` or ``omnilearn launch``): a daemon thread
  touches ``RUN_DIR/.beat-<rank>`` every :data:`BEAT_S`. A worker waiting in
  a collective still beats (TensorFlow releases the GIL); one that is
  stopped (SIGSTOP), frozen or swapped out does not. The launcher
  (:func:`silent`) names a worker whose beat is older than ``heartbeat_s``,
  stops every worker and counts it as a failure (``--max-restarts``
  restarts from the newest checkpoint). Limits: a worker alive but stuck in
  its own Python code still beats; the collective timeout (``timeout_s``)
  ends that run. On several machines no launcher watches: the collective
  timeout does.

No TensorFlow here. Run: ``python -m pytest -q tests/tf/test_tf_resume.py -k hung``
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

BEAT_DIR_ENV = "OMNILEARN_BEAT_DIR"  # set by the local launcher: where its workers beat
BEAT_S = 0.5


def beat_path(directory: Path, rank: int) -> Path:
    return Path(directory) / f".beat-{rank}"


def start_beats(rank: int, environ=os.environ) -> threading.Thread | None:
    """Beat into the launcher's directory (nothing when not started by one)."""
    directory = environ.get(BEAT_DIR_ENV)
    if not directory:
        return None
    path = beat_path(Path(directory), rank)

    def beat() -> None:
        while True:
            try:
                path.touch()
            except OSError:  # the run directory went away: the launcher is gone too
                return
            time.sleep(BEAT_S)

    thread = threading.Thread(target=beat, name="omnilearn-beat", daemon=True)
    thread.start()
    return thread


def silent(directory: Path, ranks: list[int], heartbeat_s: float, now: float | None = None) -> list[tuple[int, float]]:
    """``(rank, seconds since its last beat)`` of the ``ranks`` that beat once and then fell silent."""
    now = time.time() if now is None else now
    quiet = []
    for rank in ranks:
        try:
            age = now - beat_path(directory, rank).stat().st_mtime
        except FileNotFoundError:  # not joined yet: the join deadline is the worker's own
            continue
        if age > heartbeat_s:
            quiet.append((rank, age))
    return quiet


def absent(workers: tuple[str, ...], rank: int, connect_s: float = 1.0) -> list[tuple[int, str]]:
    """The peers whose ``host:port`` refuses a connection (they have not started their TensorFlow server)."""
    missing = []
    for peer, address in enumerate(workers):
        if peer == rank:
            continue
        host, _, port = address.rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=connect_s).close()
        except OSError:
            missing.append((peer, address))
    return missing


class JoinDeadline:
    """A watcher process for the join: ``done()`` once the cluster formed; else after ``timeout_s`` it names the
    missing peers on this worker's standard error and ends this worker (SIGKILL).

    A process, not a thread: ``MultiWorkerMirroredStrategy`` waits for its peers inside TensorFlow holding
    Python's GIL, so no thread (nor signal handler) of this process runs meanwhile. The watcher is a fresh
    interpreter running :func:`main` (the standard library only); it leaves when this worker closes its pipe
    (``done()``, or this worker's death).
    """

    def __init__(self, workers: tuple[str, ...], rank: int, timeout_s: float) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "omnilearn.tf.liveness", str(os.getpid()), f"{timeout_s:g}", str(rank),
             json.dumps(list(workers))], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)

    def done(self) -> None:
        self.process.stdin.close()
        self.process.wait()


def verdict(workers: tuple[str, ...], rank: int, timeout_s: float) -> str:
    """The line that names who did not join (probing each peer's port now)."""
    missing = absent(workers, rank)
    if not missing:
        return (f"worker {rank}: the TensorFlow cluster did not form within {timeout_s:g} s though every worker's "
                "port answers; check that every TF_CONFIG lists the same workers")
    names = ", ".join(f"worker {r} ({a})" for r, a in missing)
    return (f"worker {rank}: {names} did not join the TensorFlow cluster within {timeout_s:g} s; start "
            f"{'it' if len(missing) == 1 else 'each'} with its TF_CONFIG (task index "
            f"{', '.join(str(r) for r, _ in missing)}), or raise timeout_s")


def main(argv: list[str]) -> int:
    """The watcher of :class:`JoinDeadline`: ``PID TIMEOUT_S RANK WORKERS_JSON``."""
    pid, timeout_s, rank, workers = int(argv[0]), float(argv[1]), int(argv[2]), tuple(json.loads(argv[3]))
    ready, _, _ = select.select([sys.stdin], [], [], timeout_s)
    if ready:  # the pipe closed: the cluster formed, or the worker is gone
        return 0
    sys.stderr.write(f"omnilearn: error: {verdict(workers, rank, timeout_s)}\n")
    sys.stderr.flush()
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

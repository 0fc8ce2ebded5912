"""Start the TensorFlow workers of ``omnilearn train --framework tensorflow`` on this machine, and watch them.

Who does what. The launcher picks ``--workers`` free localhost ports and
starts one process per worker (``python -m omnilearn.experiments.tfjob
RUN_DIR``), each with its own ``TF_CONFIG`` (the cluster's addresses, its
index): a ``MultiWorkerMirroredStrategy`` cluster over gRPC, as a
TensorFlow user would start one on several machines. Worker 0's standard
output is the run's console; every worker's standard error (TensorFlow's
own messages, a traceback) goes to ``RUN_DIR/tf-worker<R>.log``.

When a worker exits badly, the others (waiting in a collective for it,
which would end in the strategy's timeout) get SIGTERM, then SIGKILL after
:data:`GRACE_S`, and :class:`~omnilearn.experiments.supervise.WorkerFailed`
names the first worker that failed with the last line of its log. SIGINT
or SIGTERM to the launcher stops every worker the same way
(:class:`~omnilearn.experiments.supervise.Interrupted`). Worker processes
sit in their own process group and die with the launcher (parent-death signal).

Run: ``python -m pytest -q tests/tf/test_tf_train.py``
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from omnilearn.experiments.config import TrainConfig
from omnilearn.experiments.supervise import Interrupted, SignalTrap, WorkerFailed, signal_name
from omnilearn.observe.console import startup
from omnilearn.tf.cluster import LOCAL_WORKERS_ENV, free_ports, local_config

GRACE_S = 3.0  # after SIGTERM: time to leave a collective, then SIGKILL
POLL_S = 0.1


def log_path(run_dir: Path, rank: int) -> Path:
    return run_dir / f"tf-worker{rank}.log"


def _die_with_parent() -> None:  # in the child, before exec: SIGKILL when the launcher goes (Linux)
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass


def start(workers: int, device: str, run_dir: Path, command: list[str],
          extra_env: dict[str, str] | None = None) -> list[subprocess.Popen]:
    """One process per worker running ``command``, each with its ``TF_CONFIG`` (and ``extra_env``)."""
    ports = free_ports(workers)
    procs = []
    for rank in range(workers):
        env = {**os.environ, "TF_CONFIG": local_config(ports, rank), LOCAL_WORKERS_ENV: str(workers),
               "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"), "PYTHONUNBUFFERED": "1",
               **(extra_env or {})}
        if device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
        with open(log_path(run_dir, rank), "ab") as log:
            procs.append(subprocess.Popen(
                command, env=env, stderr=log, stdout=None if rank == 0 else subprocess.DEVNULL,
                start_new_session=True, preexec_fn=_die_with_parent))
    return procs


def last_line(path: Path) -> str:
    """The log's last ``omnilearn:`` line (what failed), else its last line."""
    try:
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    said = [line for line in lines if line.startswith("omnilearn:")]
    return (said or lines or [""])[-1].removeprefix("omnilearn: ").removeprefix("error: ")


def stop(procs: list[subprocess.Popen], grace_s: float = GRACE_S) -> None:
    """SIGTERM to every running worker, SIGKILL to those still running ``grace_s`` later."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def run_local(cfg: TrainConfig, run_dir: Path) -> None:
    """Run the workers of ``omnilearn train --framework tensorflow`` to the end (see :func:`supervise`)."""
    supervise(cfg.workers, cfg.device, run_dir, [sys.executable, "-m", "omnilearn.experiments.tfjob", str(run_dir)],
              quiet=cfg.quiet)


def supervise(workers: int, device: str, run_dir: Path, command: list[str], extra_env: dict[str, str] | None = None,
              quiet: bool = False) -> None:
    """Run ``command`` as ``workers`` TensorFlow workers to the end; raise WorkerFailed (or Interrupted) naming the
    cause. Also the launcher of a user's own script (:mod:`omnilearn.experiments.userlaunch`)."""
    startup(f"starting {workers} TensorFlow worker processes (tf.distribute MultiWorkerMirroredStrategy; "
            f"each imports TensorFlow: seconds); their logs: {log_path(run_dir, 0).name} ...", quiet)
    first: int | None = None  # the first worker seen ending badly (the others are stopped after it)
    with SignalTrap() as trap:
        procs = start(workers, device, run_dir, command, extra_env)
        try:
            while any(p.poll() is None for p in procs):
                if trap.received:
                    stop(procs)
                    signum = trap.received[0]
                    raise Interrupted(signum, f"stopped by {signal_name(signum)}: every worker was stopped")
                failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
                if failed:
                    first = failed[0]
                    break
                time.sleep(POLL_S)
        finally:
            if any(p.poll() is None for p in procs):
                stop(procs)
    _outcome(procs, run_dir, first)


def _outcome(procs: list[subprocess.Popen], run_dir: Path, first: int | None) -> None:
    """Raise for the first worker that ended badly (a stop on request is Interrupted)."""
    codes = [p.returncode for p in procs]
    if all(c == 0 for c in codes):
        return
    rank = first if first is not None else next(r for r, c in enumerate(codes) if c != 0)
    code, said = codes[rank], last_line(log_path(run_dir, rank))
    if code in (128 + signal.SIGTERM, 128 + signal.SIGINT):
        raise Interrupted(code - 128, f"worker {rank} stopped: {said}")
    how = f"killed by {signal_name(-code)}" if code < 0 else f"exit {code}"
    raise WorkerFailed(f"TensorFlow worker {rank} failed ({how}){': ' + said if said else ''} "
                       f"(log: {log_path(run_dir, rank)})")

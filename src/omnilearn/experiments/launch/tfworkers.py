"""Start the TensorFlow workers of ``omnilearn train --framework tensorflow`` on this machine, and watch them.

Who does what. The launcher picks ``--workers`` free localhost ports and
starts one process per worker (``python -m omnilearn.experiments.train.tfjob
RUN_DIR``), each with its own ``TF_CONFIG`` (the cluster's addresses, its
index): a ``MultiWorkerMirroredStrategy`` cluster over gRPC, as a
TensorFlow user would start one on several machines. The workers fork from
one process per run that imported TensorFlow once
(:mod:`omnilearn.experiments.launch.tfforks`; ``OMNILEARN_START_METHOD=spawn``:
a fresh interpreter each). Worker 0's standard output is the run's console;
every worker's standard error (TensorFlow's own messages, a traceback) goes
to ``RUN_DIR/tf-worker<R>.log``.

When a worker exits badly, or stops beating for ``--heartbeat-s`` (hung:
:mod:`omnilearn.tf.liveness`), the others (waiting in a collective for it,
which would end in the strategy's timeout) get SIGTERM, then SIGKILL after
:data:`GRACE_S`, and :class:`~omnilearn.experiments.launch.supervise.WorkerFailed`
names the first worker that failed with the last line of its log (of
workers seen failing together, one killed by a signal: its peers' errors
follow from its death); with ``--max-restarts K`` every worker starts again
from the newest checkpoint, up to K times
(:func:`omnilearn.experiments.train.restarts.with_restarts`). SIGINT or
SIGTERM to the launcher gets every worker SIGTERM: they agree on the stop
at their next interval end and checkpoint there, and are SIGKILLed only
once overdue by the pace-measured grace both launchers use
(:class:`~omnilearn.experiments.launch.grace.StopWait`), or on a second
signal (:class:`~omnilearn.experiments.launch.supervise.Interrupted`). Worker
processes sit in their own process group and die with the launcher
(parent-death signal).

Run: ``python -m pytest -q tests/tf/test_tf_train.py``
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from omnilearn.config import dump_toml
from omnilearn.experiments.config import TrainConfig
from omnilearn.experiments.launch.supervise import (
    START_METHOD_ENV,
    Interrupted,
    SignalTrap,
    WorkerFailed,
    signal_name,
    start_method,  # re-exported: the commands check it before they write anything
)
from omnilearn.experiments.launch.grace import StopWait
from omnilearn.experiments.launch.netns import private_tmp, say_exposed
from omnilearn.experiments.launch.tfforks import Forked, ForkServer, die_with_parent
from omnilearn.experiments.train import restarts
from omnilearn.experiments.train.tfjob import JOB_CONFIG_ENV
from omnilearn.observe.console import startup
from omnilearn.tf import liveness
from omnilearn.tf.cluster import LOCAL_WORKERS_ENV, free_ports, local_config
from omnilearn.tf.liveness import BEAT_DIR_ENV

GRACE_S = 3.0  # after a failure or a hang, SIGTERM: time to leave a collective, then SIGKILL
POLL_S = 0.1
SETTLE_S = 0.5  # after a worker's error, how long a peer's death by a signal may take to be seen (the cause)


def log_path(run_dir: Path, rank: int) -> Path:
    return run_dir / f"tf-worker{rank}.log"


def common_env(workers: int, device: str) -> dict[str, str]:
    """What every worker of a launch has in its environment (its ``TF_CONFIG`` aside)."""
    env = {**os.environ, LOCAL_WORKERS_ENV: str(workers),
           "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"), "PYTHONUNBUFFERED": "1"}
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


@contextlib.contextmanager
def fork_server(workers: int, device: str, run_dir: Path, command: list[str],
                network: str = "private") -> Iterator[ForkServer | None]:
    """The run's :class:`~omnilearn.experiments.launch.tfforks.ForkServer` (Linux, unless ``OMNILEARN_START_METHOD``
    says ``spawn``), kept across restarts; ``None``: each worker is a fresh interpreter. ``network="private"``: the
    workers in a network namespace of loopback only (:mod:`omnilearn.experiments.launch.netns`); where that
    cannot be, or with ``"host"``, one line says their servers listen on every interface."""
    with private_tmp():  # the workers' TMPDIR (TensorFlow's autograph files), removed with the run
        if start_method() == "spawn":
            say_exposed(f"{START_METHOD_ENV}=spawn starts each worker on its own, outside a private network")
            yield None
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        private = network == "private"
        with ForkServer(common_env(workers, device), log_path(run_dir, 0), command, isolate=private) as server:
            if server.exposed:
                say_exposed(f"a private network could not be made: {server.exposed}" if private else "--network host")
            yield server


def start(workers: int, device: str, run_dir: Path, command: list[str], extra_env: dict[str, str] | None = None,
          server: ForkServer | None = None,
          give_up: Callable[[], bool] = lambda: False) -> list[subprocess.Popen | Forked]:
    """One process per worker running ``command`` (forked by ``server``, else a fresh interpreter), each with its
    ``TF_CONFIG`` (and ``extra_env``); ``give_up``: a stop asked for while the server imports."""
    ports = free_ports(workers)
    procs: list[subprocess.Popen | Forked] = []
    for rank in range(workers):
        env = {**common_env(workers, device), "TF_CONFIG": local_config(ports, rank), **(extra_env or {})}
        if server is not None:
            procs.append(server.start(rank, command[1:], env, log_path(run_dir, rank), rank == 0, give_up))
            continue
        with open(log_path(run_dir, rank), "ab") as log:
            procs.append(subprocess.Popen(
                command, env=env, stderr=log, stdout=None if rank == 0 else subprocess.DEVNULL,
                start_new_session=True, preexec_fn=die_with_parent))
    return procs


_NOISE = re.compile(r"^([IWEF]\d{4} \d\d:\d\d:\d\d|WARNING: All log messages before absl|To enable the following "
                    r"instructions)")  # TensorFlow's own start-up lines (glog/absl), never what failed


def last_line(path: Path) -> str:
    """The log's last ``omnilearn:`` line (what failed), else its last line that is not TensorFlow's start-up noise."""
    try:
        lines = [line for line in path.read_text(errors="replace").splitlines()
                 if line.strip() and not _NOISE.match(line)]
    except OSError:
        return ""
    said = [line for line in lines if line.startswith("omnilearn:")]
    return (said or lines or [""])[-1].removeprefix("omnilearn: ").removeprefix("error: ")


def own_line(path: Path) -> bool:
    """Whether the log has a line of OmniLearn's (``omnilearn: ...``)."""
    try:
        return any(line.startswith("omnilearn:") for line in path.read_text(errors="replace").splitlines())
    except OSError:
        return False


def stop(procs: list[subprocess.Popen], grace_s: float = GRACE_S) -> None:
    """SIGTERM to every running worker, SIGKILL to those still running ``grace_s`` later."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    _kill_running(procs)


def stop_on_request(procs: list[subprocess.Popen | Forked], trap: SignalTrap, wait: StopWait) -> str:
    """SIGTERM to every running worker (they stop at their next interval end, after a checkpoint); SIGKILL to those
    still running once ``wait`` says they are overdue, or on a second signal. Why they were killed ('' if not)."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    wait.begin()
    why = ""
    while any(p.poll() is None for p in procs) and not why:
        why = "on a second signal" if len(trap.received) > 1 else wait.why() if wait.overdue() else ""
        time.sleep(0 if why else POLL_S)
    _kill_running(procs)
    return why


def _kill_running(procs: list[subprocess.Popen | Forked]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def run_local(cfg: TrainConfig, run_dir: Path) -> None:
    """Run the workers of ``omnilearn train --framework tensorflow`` to the end, restarting them from the newest
    checkpoint after a failure up to ``--max-restarts`` times (:func:`~omnilearn.experiments.train.restarts.with_restarts`)."""
    command = [sys.executable, "-m", "omnilearn.experiments.train.tfjob", str(run_dir)]
    with fork_server(cfg.workers, cfg.device, run_dir, command) as server:
        def attempt(resume: bool) -> None:
            settings = dump_toml(dataclasses.replace(cfg, resume=resume))  # this attempt's: --workers may differ
            supervise(cfg.workers, cfg.device, run_dir, command, {JOB_CONFIG_ENV: settings}, quiet=cfg.quiet,
                      heartbeat_s=cfg.heartbeat_s, server=server, interval=cfg.control_interval)

        restarts.with_restarts(attempt, run_dir, cfg.max_restarts, cfg.resume, "tf-worker*.log",
                               lambda: tf_checkpoint(run_dir))


def tf_checkpoint(run_dir: Path) -> str:
    """What a restart resumes from: the newest TensorFlow checkpoint in ``RUN_DIR/checkpoints``."""
    steps = sorted(run_dir.glob("checkpoints/step-*/session.json"))
    return f"the checkpoint of step {int(steps[-1].parent.name[5:])}" if steps else "step 0 (no checkpoint yet)"


def supervise(workers: int, device: str, run_dir: Path, command: list[str], extra_env: dict[str, str] | None = None,
              quiet: bool = False, heartbeat_s: float | None = None, server: ForkServer | None = None,
              interval: int | None = None) -> None:
    """Run ``command`` as ``workers`` TensorFlow workers to the end; raise WorkerFailed (or Interrupted) naming the
    cause: a worker that exits badly, or one silent for ``heartbeat_s`` (:func:`omnilearn.tf.liveness.silent`).
    ``interval``: the workers' control interval, for the grace of a stop (None: the run's ``config.toml`` says).
    Also the launcher of a user's own script (:mod:`omnilearn.experiments.launch.script`)."""
    how = ("forked from one process that imports TensorFlow once" if server is not None else
           "each imports TensorFlow: seconds")
    startup(f"starting {workers} TensorFlow worker processes (tf.distribute MultiWorkerMirroredStrategy; {how}); "
            f"their logs: {log_path(run_dir, 0).name} ...", quiet)
    first: int | None = None  # the first worker seen ending badly (the others are stopped after it)
    for old in run_dir.glob(".beat-*"):
        old.unlink(missing_ok=True)
    env = {**(extra_env or {}), **({BEAT_DIR_ENV: str(run_dir)} if heartbeat_s else {})}
    with SignalTrap() as trap:
        procs = start(workers, device, run_dir, command, env, server, give_up=lambda: bool(trap.received))
        try:
            while any(p.poll() is None for p in procs):
                if trap.received:
                    killed = stop_on_request(procs, trap, StopWait([run_dir], interval))
                    signum = trap.received[0]
                    raise Interrupted(signum, f"stopped by {signal_name(signum)}: every worker was asked to stop "
                                              f"(SIGTERM){'; SIGKILLed ' + killed if killed else ''}")
                if any(p.poll() not in (None, 0) for p in procs):
                    first = first_failed(procs)
                    break
                running = [r for r, p in enumerate(procs) if p.poll() is None]
                hung = liveness.silent(run_dir, running, heartbeat_s) if heartbeat_s else []
                if hung:
                    stop(procs)
                    rank, age = hung[0]
                    raise WorkerFailed(f"TensorFlow worker {rank} hung: no heartbeat for {age:.0f} s (stopped, frozen "
                                       f"or swapped out; --heartbeat-s {heartbeat_s:g}); every worker was stopped "
                                       f"(log: {log_path(run_dir, rank)})")
                time.sleep(POLL_S)
        finally:
            if any(p.poll() is None for p in procs):  # after a worker died: time for a survivor's save first
                stop(procs, StopWait([run_dir], interval).failure_grace_s() if first is not None else GRACE_S)
            for beat in run_dir.glob(".beat-*"):
                beat.unlink(missing_ok=True)
    _outcome(procs, run_dir, first)


def first_failed(procs: list[subprocess.Popen | Forked]) -> int:
    """The worker that failed first. Peers of a worker killed by a signal (none is the launcher's yet) fail in their
    next collective, and one of them may exit before the dead one is reaped: a worker's error is only blamed once
    :data:`SETTLE_S` has shown no signal death beside it."""
    deadline = time.monotonic() + SETTLE_S
    while (time.monotonic() < deadline and not any((p.poll() or 0) < 0 for p in procs)
           and any(p.poll() is None for p in procs)):
        time.sleep(POLL_S / 5)
    failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
    return min(failed, key=lambda r: (procs[r].returncode >= 0, r))


LOST_PEER = re.compile(r"^omnilearn: worker \d+ lost a peer at step \d+ ")  # a survivor's line (omnilearn.tf.rescue)


def survivors_lines(run_dir: Path, workers: int) -> list[str]:
    """The line each survivor of a lost peer wrote into its log (what it saved, or why nothing), in rank order."""
    found = []
    for rank in range(workers):
        try:
            text = log_path(run_dir, rank).read_text(errors="replace")
        except OSError:
            continue
        found += [line for line in text.splitlines() if LOST_PEER.match(line)][-1:]
    return found


def _outcome(procs: list[subprocess.Popen | Forked], run_dir: Path, first: int | None) -> None:
    """Raise for the first worker that ended badly (a stop on request is Interrupted)."""
    codes = [p.returncode for p in procs]
    if all(c == 0 for c in codes):
        return
    rank = first if first is not None else first_failed(procs)  # every worker ended before a poll saw one
    code, said = codes[rank], last_line(log_path(run_dir, rank))
    if code in (128 + signal.SIGTERM, 128 + signal.SIGINT):
        raise Interrupted(code - 128, f"worker {rank} stopped: {said}")
    for line in survivors_lines(run_dir, len(procs)):  # what the survivors saved: on the console, not only the logs
        print(line, file=sys.stderr, flush=True)
    how = f"killed by {signal_name(-code)}" if code < 0 else f"exit {code}"
    if code < 0 and not own_line(log_path(run_dir, rank)):  # killed: its last line is whatever it printed before,
        said = ""  # not the cause, unless OmniLearn wrote it (a watcher says why it kills its worker)
    raise WorkerFailed(f"TensorFlow worker {rank} failed ({how}){': ' + said if said else ''} "
                       f"(log: {log_path(run_dir, rank)})")

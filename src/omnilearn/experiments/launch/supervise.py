"""Supervise a local launch: watch the rank processes, decide what each exit means, stop the rest, name the cause.

Who sends what, when. The launcher (:func:`omnilearn.experiments.launch.local.run_local`)
spawns one process per rank (:class:`Workers`), polls their exits every
:data:`POLL_S` (:func:`supervise`) and talks to them with signals only:
SIGTERM asks a rank to stop at its next safe point (:mod:`omnilearn.stopping`),
SIGKILL ends it after a grace period. A rank that raises writes
``RUN_DIR/error-rank<R>.log`` (unix time and cause, then the traceback) and
exits 1; so does its heartbeat watchdog (:mod:`omnilearn.distributed.watchdog`)
when a watched peer stops beating, naming that peer. A rank that stopped on
request exits 128 + the signal. SIGINT, SIGTERM or SIGHUP to the launcher
(:class:`SignalTrap`) gets every rank SIGTERM, a grace measured from the
run's pace (:class:`~omnilearn.experiments.launch.grace.StopWait`: an
interval of steps and a save, counted again while they progress toward
the stop), then SIGKILL (a second signal: at once), and raises
:class:`Interrupted`.

What an exit means (:class:`Rules`):

- BSP: every rank is needed at every step. One that fails, dies or exits
  badly fails the run: the others (stuck in a collective with it) get
  SIGTERM, time to save the last completed step (:mod:`omnilearn.bsp.rescue`;
  :func:`~omnilearn.experiments.launch.grace.rescue_grace_s`), SIGKILL; :class:`WorkerFailed` names the
  cause (:func:`blame`). One stopped by a signal sent to it (not to the
  launcher) lets the others stop too: :class:`Interrupted`.
- ASP: only the parameter server (rank 0) is needed. A worker that exits,
  fails or is killed is the server's business: it drops it (after
  ``heartbeat_s`` of silence, or at once when an exchange fails), deals its
  samples again and goes on (:mod:`omnilearn.asp.membership`); the launcher
  stops nobody. The outcome follows the server: exit 0 is success, with one
  warning line per worker lost (one still running :data:`SERVED_GRACE_S`
  after the server finished, e.g. hung and dropped, is SIGKILLed); stopped
  on request is :class:`Interrupted`; failed, killed, or named hung by a
  worker's watchdog (workers watch the server) is a :class:`WorkerFailed`
  naming ``the parameter server (rank 0)``, which ``--max-restarts``
  relaunches (the server from its checkpoint). Its workers do not hang
  meanwhile: their next request fails, or their watchdog ends them.

Slow is no failure (the watchdog thread still beats; the controller shrinks
its batches). Hung (SIGSTOP): named by its watchers within ``heartbeat_s``
(an ASP worker is dropped by the server instead). Dead (SIGKILL, the OOM
killer): seen by the launcher at once. Wrong (an exception: bad data, a full
disk, non-finite gradients, which fail the ASP server): its error log.

How the ranks start: from a fork server (Linux) that has imported torch,
``torch._dynamo`` (DDP's constructor imports it: a second) and OmniLearn's
worker code once, so a rank starts in milliseconds instead of 2-3 seconds of
imports, and a restart or the next launch of the same process reuses the
server. A rank gets the launcher's environment as it is at the start
(:func:`in_launch_env`), its working directory and ``sys.path`` (as
``spawn`` gives them). ``OMNILEARN_START_METHOD=spawn`` (or another platform, or a ``TMPDIR``
too long for the server's socket path) spawns a fresh interpreter per rank
instead.

Blame, in this order: a watchdog's verdict naming a hung rank; a rank killed
by a signal the launcher did not send (peers' errors after it are
consequences); the earliest error log; the first rank that exited badly. In
ASP only the server's exit and log, and verdicts naming it, count.

Why one file over 300 lines: what an exit means (the rules, the blame) and how the rank processes are
started, watched and stopped share one view of each process; the rules are pure and tested alone.

Run: ``python -m pytest -q tests/faults/test_stops.py tests/faults/test_asp_faults.py``
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing import connection, forkserver, reduction, util
from pathlib import Path
from typing import Callable, Sequence

import torch.multiprocessing as mp

from omnilearn.config import ConfigError
from omnilearn.experiments.launch import freshchild, mptemp
from omnilearn.experiments.launch.grace import StopWait
from omnilearn.distributed.watchdog import SERVER, ErrorLog, hung_rank, rank_name, read_error_log, read_error_logs

FAILURE_GRACE_S = 2.0  # ASP, after the server failed: its workers are stuck in exchanges with it
# (BSP: the survivors save the last completed step first: grace.rescue_grace_s)
SERVED_GRACE_S = 10.0  # ASP: after the server finished, its workers (told to stop) have this long to end
CONSEQUENCE_S = 1.0  # peers' errors written this soon before a dead rank was seen are caused by it
POLL_S = 0.1
STOPPED_CODES = (128 + signal.SIGINT, 128 + signal.SIGTERM)  # a rank that stopped on request (stopping.Stopped)
PIDS_FILE = "workers.pid"
DONE, LOST, STOPPED, FAILED, SERVED = "done", "lost", "stopped", "failed", "served"  # what an exit means


class WorkerFailed(RuntimeError):
    """A worker process died; the message names its rank and the cause."""


class Interrupted(WorkerFailed):
    """The run was stopped by ``signum`` (sent to the launcher or to a worker); ``exit_code``: 128 + signum."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + signum


# ------------------------------------------------------------ blame
@dataclass(frozen=True)
class Exit:
    rank: int
    code: int  # negative: killed by that signal
    seen: float  # unix time the launcher saw it
    ours: bool  # killed by a signal the launcher sent; or (no signal) exited after the launcher began stopping


def blame(exits: Sequence[Exit], logs: Sequence[ErrorLog], log_dir: Path, mode: str = "bsp") -> str:
    """One line naming the rank that caused a failure (see the module docstring for the order)."""
    if mode == "asp":  # only the server is needed: its workers' ends are dealt with, or consequences of its own
        exits = [e for e in exits if e.rank == SERVER]
        logs = [log for log in logs if log.rank == SERVER or hung_rank(log.cause) == SERVER]
    hung = [log for log in logs if hung_rank(log.cause) is not None]
    if hung:
        return f"{hung[0].cause} (noticed by rank {hung[0].rank}: {log_dir}/error-rank{hung[0].rank}.log)"
    logged = {log.rank for log in logs}
    deaths = sorted((e for e in exits if e.code < 0 and not e.ours and e.rank not in logged), key=lambda e: e.seen)
    if deaths and not any(log.stamp < deaths[0].seen - CONSEQUENCE_S for log in logs):
        return _died(deaths[0], mode)
    if logs:
        return _failed(logs[0], log_dir, mode)
    bad = [e for e in exits if e.code not in (0, *STOPPED_CODES)] or list(exits)
    if not bad:
        return "the run failed; see the messages above"
    first = min(bad, key=lambda e: (e.ours, e.seen))
    return f"{rank_name(first.rank, mode)} exited with code {first.code} and left no error log; see the messages above"


def _died(e: Exit, mode: str) -> str:
    return f"{rank_name(e.rank, mode)} died (killed by {signal_name(-e.code)})"


def _failed(log: ErrorLog, log_dir: Path, mode: str) -> str:
    return f"{rank_name(log.rank, mode)} failed: {log.cause} (traceback: {log_dir}/error-rank{log.rank}.log)"


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


# ------------------------------------------------------------ the processes
class SignalTrap:
    """While the workers run, SIGINT/SIGTERM (and SIGHUP unless ignored) are recorded, not raised (main thread)."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "SignalTrap":
        if threading.current_thread() is threading.main_thread():
            hup = [signal.SIGHUP] if signal.getsignal(signal.SIGHUP) not in (signal.SIG_IGN, None) else []  # nohup
            for s in (signal.SIGINT, signal.SIGTERM, *hup):
                self._previous[s] = signal.signal(s, lambda signum, frame: self.received.append(signum))
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


START_METHOD_ENV = "OMNILEARN_START_METHOD"  # "spawn": a fresh interpreter per rank (the fork server's fallback)
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "omnilearn.experiments.launch.local",
           "omnilearn.experiments.train.trainer", "omnilearn.experiments.train.asp",
           "omnilearn.experiments.launch.quickexit")  # last: the server's exit skips the final collections


def start_method() -> str:
    """``forkserver`` (Linux, unless ``OMNILEARN_START_METHOD`` asks for ``spawn``) or ``spawn``: how the workers
    of a local launch start (PyTorch's here, TensorFlow's in :mod:`omnilearn.experiments.launch.tfworkers`)."""
    method = os.environ.get(START_METHOD_ENV, "forkserver")
    if method not in ("forkserver", "spawn"):
        raise ConfigError(f"{START_METHOD_ENV}={method!r} is not a start method for the workers: use spawn or "
                          "forkserver (the default), or unset it")
    return method if sys.platform.startswith("linux") else "spawn"


def start_context():
    """The fork server, preloaded with :data:`PRELOAD` (Linux), or ``spawn`` (elsewhere, or asked for)."""
    if start_method() == "spawn":
        return mp.get_context("spawn")
    mptemp.sweep()  # the fork server directories of launchers SIGKILLed before
    mptemp.mark()  # this one's (made now: the address check below makes it anyway), swept the same way
    if not _fork_server_address_fits():
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOAD))
    return context


UNIX_SOCKET_PATH_MAX = 107  # sun_path is 108 bytes on Linux, with the terminating NUL


def _fork_server_address_fits() -> bool:
    """Whether the fork server's socket (``listener-XXXXXXXX`` in multiprocessing's temp dir, under ``TMPDIR``)
    has a short enough path: a long ``TMPDIR`` makes it fail with "AF_UNIX path too long", so spawn instead."""
    return len(os.fsencode(util.get_temp_dir())) + len("/listener-XXXXXXXX") <= UNIX_SOCKET_PATH_MAX


class _Fd:
    """The launcher's file descriptor ``fd`` as it is now, passed to the rank (a copy, received as a number)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        return _received, (reduction.DupFd(self.fd),)


def _received(dup) -> int:
    return dup.detach()


def launch_env(target: Callable[..., None]) -> tuple:
    """The arguments that make :func:`in_launch_env` run ``target`` as if spawned now: this process's environment,
    stdout and stderr as they are now (a fork server has the ones of its own start)."""
    return dict(os.environ), _Fd(1), _Fd(2), target


def in_launch_env(rank: int, env: dict[str, str], stdout: int, stderr: int, target: Callable[..., None],
                  *args) -> None:
    """A rank started with :func:`launch_env`'s arguments: the launcher's environment, stdout and stderr, then
    ``target(rank, *args)``; forked, it first gets a fresh process's signal handling and random state
    (:mod:`omnilearn.experiments.launch.freshchild`)."""
    freshchild.become_fresh()
    _leave_the_fork_servers_clients()
    os.environ.clear()
    os.environ.update(env)
    for fd, target_fd in ((stdout, 1), (stderr, 2)):
        if fd != target_fd:
            os.dup2(fd, target_fd)
            os.close(fd)
    target(rank, *args)


def _leave_the_fork_servers_clients() -> None:
    """Close this rank's copy of the fork server's "alive" pipe (every client holds one; the server ends when the
    last closes), so the server ends with the launcher and the kernel then ends the ranks (their parent death
    signal): a SIGKILLed launcher takes its ranks with it, as with ``spawn``."""
    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if isinstance(fd, int):
        try:
            os.close(fd)
        except OSError:
            pass
        server._forkserver_alive_fd = None


class Workers:
    """The rank processes of one launch and how each ended."""

    def __init__(self) -> None:
        self.procs: list = []
        self.exits: dict[int, Exit] = {}
        self.stopping = False  # the launcher asked them to stop, or one stopped on request: later exits are not causes
        self.sent: set[int] = set()  # signals the launcher sent
        self.killed: list[int] = []  # ranks SIGKILLed
        self.why_killed = ""

    def start(self, count: int, target: Callable[..., None], args: tuple, log_dir: Path, trap: SignalTrap) -> None:
        """Start ``target(rank, *args)`` for ranks ``0..count-1`` (none after a trapped signal); write the pid file."""
        context = start_context()
        for rank in range(count):
            if trap.received:  # interrupted while starting: start no more
                break
            p = context.Process(target=in_launch_env, args=(rank, *launch_env(target), *args),
                                name=f"omnilearn-rank{rank}")
            p.start()
            self.procs.append(p)
        try:
            (log_dir / PIDS_FILE).write_text("".join(f"{r} {p.pid}\n" for r, p in enumerate(self.procs)))
        except OSError:
            pass  # informational only

    def alive(self) -> list[int]:
        return [r for r in range(len(self.procs)) if r not in self.exits]

    def reap(self, timeout_s: float) -> list[Exit]:
        """Wait up to ``timeout_s`` for an exit; the workers that ended since the last call."""
        if self.alive():
            connection.wait([self.procs[r].sentinel for r in self.alive()], timeout_s)
        now, new = time.time(), []
        for r in self.alive():
            code = self.procs[r].exitcode
            if code is not None:
                ours = -code in self.sent if code < 0 else self.stopping  # a peer's SIGKILL is never ours
                new.append(Exit(r, code, now, ours))
        self.exits.update((e.rank, e) for e in new)
        return new

    def send(self, signum: int) -> None:
        self.sent.add(signum)
        for r in self.alive():
            try:
                os.kill(self.procs[r].pid, signum)  # not reaped yet: the pid is still this child's
            except ProcessLookupError:
                pass

    def ask_to_stop(self, grace_s: float) -> float:
        """SIGTERM to every live worker; the time (monotonic) after which they are killed."""
        self.stopping = True
        self.send(signal.SIGTERM)
        return time.monotonic() + grace_s

    def kill(self, why: str) -> None:
        if not self.alive():
            return
        self.killed += self.alive()
        self.why_killed = self.why_killed or why
        self.send(signal.SIGKILL)
        for r in self.alive():
            self.procs[r].join(5.0)


# ------------------------------------------------------------ what an exit means
@dataclass(frozen=True)
class Rules:
    """How one launch reads its exits: ``mode`` ``bsp`` (every rank is needed) or ``asp`` (only the server)."""

    mode: str
    log_dir: Path
    since: float  # unix time the launch began: older error logs are another launch's

    def needed(self, rank: int) -> bool:
        return self.mode != "asp" or rank == SERVER

    def judge(self, e: Exit) -> str:
        """DONE, LOST (an ASP worker: the server goes on), STOPPED (on request), FAILED, or SERVED (ASP server: 0)."""
        if not self.needed(e.rank):
            return DONE if e.code == 0 else FAILED if not e.ours and self.names_server_hung(e.rank) else LOST
        if e.code in STOPPED_CODES:
            return STOPPED
        if e.code != 0:
            return DONE if e.ours else FAILED
        return SERVED if self.mode == "asp" else DONE

    def names_server_hung(self, rank: int) -> bool:
        """Whether ``rank``'s error log of this launch is its watchdog's verdict on the server."""
        log = read_error_log(self.log_dir / f"error-rank{rank}.log")
        return log is not None and log.stamp >= self.since and hung_rank(log.cause) == SERVER


def supervise(workers: Workers, trap: SignalTrap, rules: Rules,
              stop_wait: StopWait | None = None) -> tuple[int | None, Exit | None]:
    """Wait for every worker; (the signal that interrupted the launch, the exit that failed the run), None if not.
    ``stop_wait``: how long a stop on request may take (default: read from ``rules.log_dir``)."""
    interrupted, failed, deadline = None, None, math.inf
    stop_wait = stop_wait or StopWait([rules.log_dir])
    while workers.alive():
        for e in workers.reap(POLL_S):
            meaning = rules.judge(e)
            if meaning == STOPPED and not workers.stopping:  # stopped on its own request: let the rest stop too
                workers.stopping = True
                stop_wait.begin()
            elif meaning == FAILED and failed is None and interrupted is None:
                grace = stop_wait.failure_grace_s() if rules.mode == "bsp" else FAILURE_GRACE_S
                failed, deadline = e, workers.ask_to_stop(grace)
            elif meaning == SERVED:  # its live workers were told to stop; a dropped one may hang
                deadline = min(deadline, time.monotonic() + SERVED_GRACE_S)
        if trap.received and interrupted is None and failed is None:
            interrupted = trap.received[0]
            workers.ask_to_stop(math.inf)
            stop_wait.begin()
        if len(trap.received) > 1:  # a second signal: no more waiting
            workers.kill("on a second signal")
        elif time.monotonic() > deadline:
            workers.kill("after the grace period")
        elif failed is None and stop_wait.overdue():
            workers.kill(stop_wait.why())
    return (interrupted or (trap.received[0] if trap.received and failed is None else None)), failed


def outcome(workers: Workers, interrupted: int | None, failed: Exit | None, rules: Rules) -> None:
    """Raise what the launch came to; return (after any warnings) when the run finished its jobs."""
    killed = f"; rank {','.join(map(str, workers.killed))} SIGKILLed {workers.why_killed}" if workers.killed else ""
    if interrupted is not None:
        raise Interrupted(interrupted, f"interrupted by {signal_name(interrupted)}: every worker was asked to stop "
                                       f"(SIGTERM){killed}")
    if failed is not None:
        logs = read_error_logs(rules.log_dir, rules.since)
        raise WorkerFailed(blame(list(workers.exits.values()), logs, rules.log_dir, rules.mode))
    stopped = sorted((e for e in workers.exits.values() if e.code in STOPPED_CODES and rules.needed(e.rank)),
                     key=lambda e: e.seen)
    if stopped:
        signum = stopped[0].code - 128
        raise Interrupted(signum, f"stopped by {signal_name(signum)} sent to {rank_name(stopped[0].rank, rules.mode)} "
                                  f"(not to the launcher): the workers ended at their next safe point{killed}")
    for line in lost_workers(workers, rules):
        print(f"omnilearn: warning: {line}", file=sys.stderr, flush=True)


def lost_workers(workers: Workers, rules: Rules) -> list[str]:
    """One line per worker the run went on without (ASP; a BSP run that finished lost none)."""
    logs = {log.rank: log for log in read_error_logs(rules.log_dir, rules.since)}
    lines = []
    for e in sorted(workers.exits.values(), key=lambda e: e.rank):
        if rules.needed(e.rank) or e.code == 0:
            continue
        if e.rank in workers.killed:
            lines.append(f"worker rank {e.rank} had not ended {SERVED_GRACE_S:g} s after the server finished "
                         "(hung?); it was SIGKILLed")
            continue
        log = logs.get(e.rank)
        ended = _died(e, rules.mode) if e.code < 0 else _failed(log, rules.log_dir, rules.mode) if log else \
            f"worker rank {e.rank} exited with code {e.code}"
        lines.append(f"{ended}; the server dealt its samples to the others")
    return lines

"""Start the workers: spawn ``--workers`` local processes, or join a torchrun group; stop them all, cleanly.

Local runs rendezvous through a file store in a private temp directory (no
port to pick or collide on); the launcher writes ``RUN_DIR/workers.pid``
(``rank pid`` lines) while they run. A worker that raises writes
``RUN_DIR/error-rank<R>.log`` (first line: when and what, then the
traceback) and exits 1; one that stopped on request exits 128 + the signal.
Every rank runs the heartbeat watchdog (:mod:`omnilearn.distributed.watchdog`):
a rank that stops answering for ``heartbeat_s`` is named in a peer's error
log. Local workers beat from their first line on a store file of their own,
so a rank stuck while starting or joining is named too (after
:data:`STARTUP_S`); torchrun ranks beat once joined.

Stops. SIGINT, SIGTERM (or SIGHUP) to the launcher sends SIGTERM to every
worker (they stop at their next safe point, :mod:`omnilearn.stopping`),
waits up to :data:`STOP_GRACE_S`, SIGKILLs what is left, removes the store
and raises :class:`Interrupted`; a second signal kills at once. A failed
worker gets the others SIGTERMed, then SIGKILLed after
:data:`FAILURE_GRACE_S`. Workers sit in their own process group (a
terminal's Ctrl-C reaches the launcher only, which asks each worker once)
and die with the launcher (parent-death signal, Linux).

Blame, in this order: a watchdog's verdict naming a hung rank; a worker
killed by a signal the launcher did not send (peers' errors after it are
consequences); the earliest error log; the first worker that exited badly.

Run: ``python -m pytest -q tests/faults/test_stops.py tests/dist/test_bsp.py``
"""

from __future__ import annotations

import ctypes
import math
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing import connection
from pathlib import Path
from typing import Callable, Sequence

import torch.distributed as dist
import torch.multiprocessing as mp

from omnilearn import stopping
from omnilearn.distributed import group
from omnilearn.distributed.watchdog import Watchdog, exit_on_lost, hung_rank, start_watchdog, write_error_log
from omnilearn.experiments.config import TrainConfig

STOP_GRACE_S = 8.0  # after SIGTERM on an interrupt: time to reach a safe point and checkpoint, then SIGKILL
FAILURE_GRACE_S = 2.0  # after a worker failed: its peers are stuck in collectives with it
STARTUP_S = 30.0  # a worker not heard from at all yet is given this long to start (imports) before it is named
CONSEQUENCE_S = 1.0  # peers' errors written this soon before a dead rank was seen are caused by it
POLL_S = 0.1
STOPPED_CODES = (128 + signal.SIGINT, 128 + signal.SIGTERM)  # a worker that stopped on request (stopping.Stopped)
PIDS_FILE = "workers.pid"
PR_SET_PDEATHSIG = 1  # linux/prctl.h


class WorkerFailed(RuntimeError):
    """A worker process died; the message names its rank and the cause."""


class Interrupted(WorkerFailed):
    """The run was stopped by ``signum`` (sent to the launcher or to a worker); ``exit_code``: 128 + signum."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + signum


@dataclass(frozen=True)
class Job:
    """One training run in a launch: ``kind`` is ``omnilearn`` or ``ddp`` (the plain-DDP baseline).

    An ``omnilearn`` job with ``--mode asp`` runs a parameter server (rank 0) besides the workers.
    """

    cfg: TrainConfig
    run_dir: Path
    kind: str = "omnilearn"


def _run_job(job: Job, ctx: group.DistContext) -> dict | None:
    run_dir = job.run_dir if ctx.is_main else None
    if job.kind == "ddp":
        from omnilearn.experiments.plainddp import train_plain_ddp

        return train_plain_ddp(job.cfg, ctx, run_dir)
    if job.cfg.mode == "asp":
        from omnilearn.experiments.asp_train import train_asp

        return train_asp(job.cfg, ctx, run_dir)
    from omnilearn.experiments.trainer import BSPTrainer

    return BSPTrainer(job.cfg, ctx, run_dir).fit()


def processes(cfg: TrainConfig) -> int:
    """Processes in the group: the workers, plus the parameter server in ASP."""
    return cfg.workers + (1 if cfg.mode == "asp" else 0)


# ------------------------------------------------------------------ one rank
def _run_rank(join: Callable[[], group.DistContext], rank: int, jobs: Sequence[Job], log_dir: Path | None,
              watch_early: Callable[[], Watchdog] | None = None) -> None:
    """Watch the peers (before joining with ``watch_early``, else after), join, run the jobs; log errors, not stops."""
    watchdog = None
    try:
        watchdog = watch_early() if watch_early else None
        ctx = join()
        watchdog = watchdog or start_watchdog(ctx, jobs[0].cfg.heartbeat_s, log_dir)
        for job in jobs:
            _run_job(job, ctx)
            group.barrier()  # move on together: rank 0 may still be writing the run directory
    except (stopping.Stopped, SystemExit):
        raise
    except BaseException as e:
        _log_failure(log_dir, rank, e)
        raise
    finally:
        if watchdog is not None:
            watchdog.stop()
        group.destroy()


def _log_failure(log_dir: Path | None, rank: int, e: BaseException) -> None:
    cause = (traceback.format_exception_only(type(e), e)[-1].strip().splitlines() or [type(e).__name__])[0]
    if log_dir is not None and not write_error_log(log_dir, rank, cause, traceback.format_exc()):
        print(f"omnilearn: worker rank {rank} failed and could not write {log_dir}/error-rank{rank}.log "
              f"(disk full?): {cause}", file=sys.stderr, flush=True)


def _spawned(local_rank: int, jobs: Sequence[Job], log_dir: Path, store: str, launcher_pid: int) -> None:
    """A local worker: die with the launcher, stop on signals, beat from the start (own store file), then join."""
    _die_with_launcher(launcher_pid, local_rank)
    stopping.install_handlers()
    cfg, n = jobs[0].cfg, processes(jobs[0].cfg)

    def watch() -> Watchdog:  # from the start, on a store file of its own: a rank hung while joining is named too
        return Watchdog(dist.FileStore(f"{store}/heartbeat", n), local_rank, n, cfg.heartbeat_s,
                        exit_on_lost(local_rank, log_dir, echo=False), first_beat_s=STARTUP_S).start()

    def join() -> group.DistContext:
        return group.init(local_rank, n, local_rank, n, cfg.device, cfg.timeout_s, f"file://{store}/store",
                          _backend(cfg))

    try:
        _run_rank(join, local_rank, jobs, log_dir, watch)
    except stopping.Stopped:
        sys.exit(_stop_code())
    except SystemExit:
        raise
    except BaseException:  # noqa: BLE001 - logged by _run_rank; the launcher reports it in one line
        sys.exit(1)


def _die_with_launcher(launcher_pid: int, rank: int) -> None:
    """The kernel SIGKILLs this worker when the launcher dies (Linux); a launcher already gone ends it now."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass
    try:
        os.setpgid(0, 0)  # a terminal's Ctrl-C reaches the launcher only, which then asks each worker once
    except OSError:
        pass
    if os.getppid() != launcher_pid:
        print(f"omnilearn: worker rank {rank}: the launcher (pid {launcher_pid}) is gone; exiting", file=sys.stderr)
        os._exit(1)


def _stop_code() -> int:
    """128 + the signal that asked for the stop (``stopping.reason()`` starts with its name), SIGTERM by default."""
    name = stopping.reason().split(" ")[0]
    return 128 + (signal.Signals[name] if name in signal.Signals.__members__ else signal.SIGTERM)


# ------------------------------------------------------------ the launcher
@dataclass(frozen=True, order=True)
class ErrorLog:
    stamp: float  # unix time of the error
    rank: int
    cause: str


def read_error_logs(log_dir: Path, since: float = 0.0) -> list[ErrorLog]:
    """The ``error-rank*.log`` in ``log_dir`` stamped at or after ``since``, oldest first; damaged ones by mtime."""
    found = []
    for path in Path(log_dir).glob("error-rank*.log"):
        try:
            rank = int(path.stem.removeprefix("error-rank"))
            first = path.read_text(encoding="utf-8", errors="replace").partition("\n")[0].strip()
            mtime = path.stat().st_mtime
        except (OSError, ValueError):
            continue
        stamp, _, cause = first.partition(" ")
        try:
            when = float(stamp)
        except ValueError:
            when, cause = mtime, first
        if when >= since:
            found.append(ErrorLog(when, rank, cause.strip() or "(empty error log)"))
    return sorted(found)


def first_failure(run_dir: Path) -> tuple[int, str] | None:
    """(rank, cause) of the earliest ``error-rank*.log`` in ``run_dir``."""
    logs = read_error_logs(run_dir)
    return (logs[0].rank, logs[0].cause) if logs else None


@dataclass(frozen=True)
class Exit:
    rank: int
    code: int  # negative: killed by that signal
    seen: float  # unix time the launcher saw it
    ours: bool  # killed by a signal the launcher sent; or (no signal) exited after the launcher began stopping


def blame(exits: Sequence[Exit], logs: Sequence[ErrorLog], log_dir: Path) -> str:
    """One line naming the rank that caused a failure (see the module docstring for the order)."""
    hung = [log for log in logs if hung_rank(log.cause) is not None]
    if hung:
        return f"{hung[0].cause} (noticed by rank {hung[0].rank}: {log_dir}/error-rank{hung[0].rank}.log)"
    logged = {log.rank for log in logs}
    deaths = sorted((e for e in exits if e.code < 0 and not e.ours and e.rank not in logged), key=lambda e: e.seen)
    if deaths and not any(log.stamp < deaths[0].seen - CONSEQUENCE_S for log in logs):
        return f"worker rank {deaths[0].rank} died (killed by {_signal_name(-deaths[0].code)})"
    if logs:
        return f"worker rank {logs[0].rank} failed: {logs[0].cause} (traceback: {log_dir}/error-rank{logs[0].rank}.log)"
    bad = [e for e in exits if e.code not in (0, *STOPPED_CODES)] or list(exits)
    first = min(bad, key=lambda e: (e.ours, e.seen))
    return f"worker rank {first.rank} exited with code {first.code} and left no error log; see the messages above"


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class _SignalTrap:
    """While the workers run, SIGINT/SIGTERM (and SIGHUP unless ignored) are recorded, not raised (main thread)."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "_SignalTrap":
        if threading.current_thread() is threading.main_thread():
            hup = [signal.SIGHUP] if signal.getsignal(signal.SIGHUP) not in (signal.SIG_IGN, None) else []  # nohup
            for s in (signal.SIGINT, signal.SIGTERM, *hup):
                self._previous[s] = signal.signal(s, lambda signum, frame: self.received.append(signum))
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


class _Workers:
    """The spawned worker processes of one launch and how each ended."""

    def __init__(self) -> None:
        self.procs: list = []
        self.exits: dict[int, Exit] = {}
        self.stopping = False  # the launcher asked them to stop, or one stopped on request: later exits are not causes
        self.sent: set[int] = set()  # signals the launcher sent
        self.killed: list[int] = []  # ranks SIGKILLed
        self.why_killed = ""

    def start(self, jobs: Sequence[Job], log_dir: Path, store: str, trap: _SignalTrap) -> None:
        spawn = mp.get_context("spawn")
        for rank in range(processes(jobs[0].cfg)):
            if trap.received:  # interrupted while starting: start no more
                break
            p = spawn.Process(target=_spawned, args=(rank, list(jobs), log_dir, store, os.getpid()),
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


def _supervise(workers: _Workers, trap: _SignalTrap) -> tuple[int | None, Exit | None]:
    """Wait for every worker; (the signal that interrupted the launch, the first worker that failed), None if not."""
    interrupted, failed, deadline = None, None, math.inf
    while workers.alive():
        for e in workers.reap(POLL_S):
            if e.code in STOPPED_CODES and not workers.stopping:  # stopped on its own request: let the rest stop too
                workers.stopping, deadline = True, time.monotonic() + STOP_GRACE_S
            elif e.code != 0 and not e.ours and failed is None and interrupted is None:
                failed, deadline = e, workers.ask_to_stop(FAILURE_GRACE_S)
        if trap.received and interrupted is None and failed is None:
            interrupted, deadline = trap.received[0], workers.ask_to_stop(STOP_GRACE_S)
        if len(trap.received) > 1:  # a second signal: no more waiting
            workers.kill("on a second signal")
        elif time.monotonic() > deadline:
            workers.kill("after the grace period")
    return (interrupted or (trap.received[0] if trap.received and failed is None else None)), failed


def _outcome(workers: _Workers, interrupted: int | None, failed: Exit | None, log_dir: Path, since: float) -> None:
    """Raise what the launch came to; return when every worker finished its jobs."""
    killed = f"; rank {','.join(map(str, workers.killed))} SIGKILLed {workers.why_killed}" if workers.killed else ""
    if interrupted is not None:
        raise Interrupted(interrupted, f"interrupted by {_signal_name(interrupted)}: every worker was asked to stop "
                                       f"(SIGTERM){killed}")
    if failed is not None:
        raise WorkerFailed(blame(list(workers.exits.values()), read_error_logs(log_dir, since), log_dir))
    stopped = sorted((e for e in workers.exits.values() if e.code in STOPPED_CODES), key=lambda e: e.seen)
    if stopped:
        signum = stopped[0].code - 128
        raise Interrupted(signum, f"stopped by {_signal_name(signum)} sent to worker rank {stopped[0].rank} "
                                  f"(not to the launcher): the workers ended at their next safe point{killed}")


def run_local(jobs: Sequence[Job], log_dir: Path) -> None:
    """Spawn ``jobs[0].cfg.workers`` local workers once and run every job in them, in order.

    Raises :class:`WorkerFailed` naming the rank at fault, or :class:`Interrupted` after a stop.
    Call it from the main thread: elsewhere signals are not trapped (the workers still die with it).
    """
    since = time.time()
    workers = _Workers()
    with _SignalTrap() as trap:
        store = tempfile.mkdtemp(prefix="omnilearn-store-")
        os.environ["OMNILEARN_RUN_ID"] = run = f"{os.getpid()}-{int(time.time())}"  # inherited by the workers
        try:
            workers.start(jobs, log_dir, store, trap)
            interrupted, failed = _supervise(workers, trap)
        finally:
            workers.kill("as the launcher failed")  # none left but after an error in the launcher itself
            shutil.rmtree(store, ignore_errors=True)
            try:
                (log_dir / PIDS_FILE).unlink(missing_ok=True)
            except OSError:
                pass
            if any(job.cfg.emulator == "cgroup" for job in jobs):
                _cleanup_cgroups(run)
    _outcome(workers, interrupted, failed, log_dir, since)


def _cleanup_cgroups(run: str) -> None:
    """Remove the run's cgroups, also after a crash or Ctrl-C; a failure here is a warning, not the error."""
    from omnilearn.emulation.throttle import ThrottleError, cleanup_run

    try:
        cleanup_run(run)
    except ThrottleError as e:
        print(f"omnilearn: warning: {e}", file=sys.stderr)


def run_torchrun(jobs: Sequence[Job], log_dir: Path | None) -> None:
    """This process is one rank of a torchrun job; the run directories matter on rank 0 only.

    A stop (torchrun forwards SIGTERM/SIGINT) raises :class:`omnilearn.stopping.Stopped` for the caller to map.
    """
    stopping.install_handlers()
    cfg = jobs[0].cfg
    _run_rank(lambda: group.init_from_torchrun(cfg.device, cfg.timeout_s, _backend(cfg)), int(os.environ["RANK"]),
              jobs, log_dir)


def _backend(cfg: TrainConfig) -> str | None:
    """ASP talks point-to-point with CPU tensors: gloo, whatever the workers' device."""
    return "gloo" if cfg.mode == "asp" else None

"""Start the workers: spawn ``--workers`` local processes (plus the ASP server), or join a torchrun group.

Local runs rendezvous through a file store in a private temp directory (no
port to pick or collide on); the launcher writes ``RUN_DIR/workers.pid``
(``rank pid`` lines) while they run. Each rank runs its jobs in order
(:func:`_run_rank`); a rank that raises writes ``RUN_DIR/error-rank<R>.log``
(first line: when and what, then the traceback) and exits 1; one that
stopped on request exits 128 + the signal. BSP ranks meet at a barrier after
each job (rank 0 may still be writing the run directory); ASP ranks do not
(a dead worker would fail it): between two jobs of one launch the workers
wait for the server to end the job, on a store key, and nobody waits for a
worker. Every rank leaves through :func:`omnilearn.distributed.group.destroy`,
the teardown ``Session.close()`` uses too (its models let go of the group
first, so no gloo thread outlives it into interpreter finalisation).

Every rank runs the heartbeat watchdog (:mod:`omnilearn.distributed.watchdog`):
in BSP each watches the next two ranks, in ASP each worker watches the
server, which beats but watches nobody (it drops a silent worker itself). A
rank that stops answering for ``heartbeat_s`` is named in a watcher's error
log. Local ranks beat from their first line on a store file of their own, so
a rank stuck while starting or joining is named too (after
:data:`STARTUP_S`); torchrun ranks beat once joined. Local ranks sit in their
own process group (a terminal's Ctrl-C reaches the launcher only, which asks
each rank once) and die with the launcher (parent-death signal, Linux).

What the launcher does when a rank exits, stops, hangs or fails -- and why
a dead ASP worker does not end the run -- is :mod:`omnilearn.experiments.launch.supervise`.

Start-up progress (not when ``quiet``): the launcher says which processes it
starts, rank 0 how long they took to come up and join (each starts Python
and imports PyTorch: seconds, more on a loaded machine); the trainer goes on.

Why one file over 300 lines: both launchers (local ranks and ``torchrun``) and what runs inside a local rank
(its jobs, its error log, its death with the launcher) are one protocol; the supervision is apart.

Run: ``python -m pytest -q tests/faults/test_stops.py tests/faults/test_asp_faults.py tests/dist/test_bsp.py``
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable, Sequence

import torch.distributed as dist

from omnilearn import stopping
from omnilearn.distributed import group
from omnilearn.distributed.watchdog import (SERVER, Watchdog, exit_on_lost, rank_name, read_error_logs,
                                            start_watchdog, write_error_log)
from omnilearn.experiments.config import TrainConfig
from omnilearn.experiments.launch.grace import StopWait
from omnilearn.experiments.launch.netns import sweep_gone
from omnilearn.observe.console import startup, took
from omnilearn.runplan import SpeedScheduleWarning
from omnilearn.experiments.launch.supervise import (PIDS_FILE, Interrupted, Rules, SignalTrap, WorkerFailed, Workers, outcome,
                                             supervise)

__all__ = ["Interrupted", "Job", "WorkerFailed", "first_failure", "processes", "run_local", "run_torchrun"]

STARTUP_S = 30.0  # a rank not heard from at all yet is given this long to start (imports) before it is named
PR_SET_PDEATHSIG = 1  # linux/prctl.h


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
        from omnilearn.experiments.bench.plainddp import train_plain_ddp

        return train_plain_ddp(job.cfg, ctx, run_dir)
    if mode_of(job) == "asp":
        from omnilearn.experiments.train.asp import train_asp

        return train_asp(job.cfg, ctx, run_dir)
    from omnilearn.experiments.train.trainer import BSPTrainer

    return BSPTrainer(job.cfg, ctx, run_dir).fit()


def processes(cfg: TrainConfig) -> int:
    """Processes in the group: the workers, plus the parameter server in ASP."""
    return cfg.workers + (1 if cfg.mode == "asp" else 0)


def mode_of(job: Job) -> str:
    """``asp`` for a parameter-server job (only the server is needed), else ``bsp`` (every rank is)."""
    return "asp" if job.kind == "omnilearn" and job.cfg.mode == "asp" else "bsp"


def first_failure(run_dir: Path) -> tuple[int, str] | None:
    """(rank, cause) of the earliest ``error-rank*.log`` in ``run_dir``."""
    logs = read_error_logs(run_dir)
    return (logs[0].rank, logs[0].cause) if logs else None


# ------------------------------------------------------------------ one rank
def _run_rank(join: Callable[[], group.DistContext], rank: int, jobs: Sequence[Job], log_dir: Path | None,
              watch_early: Callable[[], Watchdog] | None = None, gate: dist.Store | None = None,
              started_at: float | None = None) -> None:
    """Watch the peers (before joining with ``watch_early``, else after), join, run the jobs; log errors, not stops.

    ``gate``: a store every rank shares, for ASP ranks to move on between jobs (:func:`_between_asp_jobs`).
    ``started_at``: when the launcher started the processes (``time.time()``), for rank 0's start-up line.
    """
    watchdog, clean = None, False
    warnings.simplefilter("ignore", SpeedScheduleWarning)  # the launcher (torchrun: rank 0) said it, in flags
    try:
        watchdog = watch_early() if watch_early else None
        joining = time.time()
        ctx = join()
        if ctx.is_main:
            since = f"up and joined in {took(time.time() - started_at)}" if started_at else \
                f"joined in {took(time.time() - joining)}"
            n = ctx.world_size
            startup(f"{n} process{'es' if n > 1 else ''} {since} ({ctx.backend}, {ctx.device.type})", jobs[0].cfg.quiet)
        watchdog = watchdog or start_watchdog(ctx, jobs[0].cfg.heartbeat_s, log_dir, mode=mode_of(jobs[0]))
        for k, job in enumerate(jobs):
            _run_job(job, ctx)
            if stopping.stop_requested():  # a stop ends the launch, not only this job (a bench's next arm)
                raise stopping.Stopped(stopping.reason() or "a stop signal")
            if mode_of(job) == "bsp":
                group.barrier()  # move on together: rank 0 may still be writing the run directory
            elif k + 1 < len(jobs):
                _between_asp_jobs(k, job, ctx, gate)
        clean = True
    except (stopping.Stopped, SystemExit):
        raise
    except BaseException as e:
        _log_failure(log_dir, rank, e, mode_of(jobs[0]))
        raise
    finally:
        if watchdog is not None:
            watchdog.stop()
        group.destroy(wait_s=3.0 if clean else 0.0)  # the one teardown; after a failure a peer may be gone: no wait


def _between_asp_jobs(k: int, job: Job, ctx: group.DistContext, gate: dist.Store | None) -> None:
    """The workers wait for the server to end job ``k`` (their next job's first request must not reach this job's
    server); nobody waits for a worker, which may be dead. Without a ``gate`` (torchrun): a barrier."""
    key = f"omnilearn/asp-job/{k}/over"
    if gate is None:
        group.barrier()
    elif ctx.rank == SERVER:
        gate.set(key, "1")
    else:
        gate.wait([key], timedelta(seconds=job.cfg.timeout_s))


def _log_failure(log_dir: Path | None, rank: int, e: BaseException, mode: str) -> None:
    cause = (traceback.format_exception_only(type(e), e)[-1].strip().splitlines() or [type(e).__name__])[0]
    if log_dir is not None and not write_error_log(log_dir, rank, cause, traceback.format_exc()):
        print(f"omnilearn: {rank_name(rank, mode)} failed and could not write {log_dir}/error-rank{rank}.log "
              f"(disk full?): {cause}", file=sys.stderr, flush=True)


def _spawned(local_rank: int, jobs: Sequence[Job], log_dir: Path, store: str, launcher_pid: int,
             started_at: float | None = None) -> None:
    """A local worker: die with the launcher, stop on signals, beat from the start (own store file), then join."""
    _die_with_launcher(launcher_pid, local_rank)
    stopping.install_handlers()
    cfg, n = jobs[0].cfg, processes(jobs[0].cfg)

    def watch() -> Watchdog:  # from the start, on a store file of its own: a rank hung while joining is named too
        return Watchdog(dist.FileStore(f"{store}/heartbeat", n), local_rank, n, cfg.heartbeat_s,
                        exit_on_lost(local_rank, log_dir, echo=False), first_beat_s=STARTUP_S,
                        mode=mode_of(jobs[0])).start()

    def join() -> group.DistContext:
        return group.init(local_rank, n, local_rank, n, cfg.device, cfg.timeout_s, f"file://{store}/store",
                          _backend(cfg))

    try:
        gate = dist.FileStore(f"{store}/jobs", n) if len(jobs) > 1 and mode_of(jobs[0]) == "asp" else None
        _run_rank(join, local_rank, jobs, log_dir, watch, gate, started_at)
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
    if not _alive(launcher_pid):  # its parent is the fork server (or the launcher, when spawned)
        print(f"omnilearn: worker rank {rank}: the launcher (pid {launcher_pid}) is gone; exiting", file=sys.stderr)
        os._exit(1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stop_code() -> int:
    """128 + the signal that asked for the stop (``stopping.reason()`` starts with its name), SIGTERM by default."""
    name = stopping.reason().split(" ")[0]
    return 128 + (signal.Signals[name] if name in signal.Signals.__members__ else signal.SIGTERM)


# ------------------------------------------------------------ the launcher
def run_local(jobs: Sequence[Job], log_dir: Path) -> None:
    """Spawn the ranks of ``jobs[0].cfg`` (:func:`processes`) once and run every job in them, in order.

    Raises :class:`WorkerFailed` naming the rank at fault, or :class:`Interrupted` after a stop; an ASP run
    whose server finished returns, warning about each worker it lost (:mod:`omnilearn.experiments.launch.supervise`).
    Call it from the main thread: elsewhere signals are not trapped (the workers still die with it).
    """
    modes = {mode_of(job) for job in jobs}
    if len(modes) != 1:
        raise ValueError(f"one launch runs jobs of one mode, got {sorted(modes)}: launch them apart")
    rules = Rules(modes.pop(), Path(log_dir), time.time())
    workers = Workers()
    with SignalTrap() as trap:
        store = private_store_dir()
        os.environ["OMNILEARN_RUN_ID"] = run = f"{os.getpid()}-{int(time.time())}"  # inherited by the workers
        if "GLOO_SOCKET_IFNAME" not in os.environ and Path("/sys/class/net/lo").exists():
            os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # local workers talk over loopback only (the trust model)
        try:
            startup(f"starting {_describe(jobs[0].cfg)} ...", jobs[0].cfg.quiet)
            args = (list(jobs), log_dir, store, os.getpid(), time.time())
            workers.start(processes(jobs[0].cfg), _spawned, args, log_dir, trap)
            stop_wait = StopWait([job.run_dir for job in jobs], max(job.cfg.control_interval for job in jobs))
            interrupted, failed = supervise(workers, trap, rules, stop_wait)
        finally:
            workers.kill("as the launcher failed")  # none left but after an error in the launcher itself
            shutil.rmtree(store, ignore_errors=True)
            try:
                (log_dir / PIDS_FILE).unlink(missing_ok=True)
            except OSError:
                pass
            if any(job.cfg.emulator == "cgroup" for job in jobs):
                _cleanup_cgroups(run)
    outcome(workers, interrupted, failed, rules)


STORE_PREFIX = "omnilearn-store-"


def private_store_dir() -> str:
    """A new temp directory for the rendezvous files, named after this launcher's pid; first remove those of
    launchers that are gone (a SIGKILLed launcher cannot clean up: its workers die with it, its directory stays)."""
    sweep_gone(Path(tempfile.gettempdir()), STORE_PREFIX)
    return tempfile.mkdtemp(prefix=f"{STORE_PREFIX}{os.getpid()}-")


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


def _describe(cfg: TrainConfig) -> str:
    """``4 worker processes (gloo, cpu; speeds emulated by delay)``: what the launcher starts."""
    n = processes(cfg)
    device = group.pick_device(cfg.device, 0, n).type
    backend = _backend(cfg) or ("nccl" if device == "cuda" else "gloo")
    plural = "s" if cfg.workers > 1 else ""
    who = f"a parameter server and {cfg.workers} worker{plural}" if cfg.mode == "asp" else \
        f"{n} worker process{'es' if plural else ''}"
    varied = cfg.speed_schedule is not None or len(set(cfg.declared_speeds)) > 1
    emulated = f"; speeds emulated by {cfg.emulator}" if cfg.emulator != "none" and varied else ""
    return f"{who} ({backend}, {device}{emulated})"


def _backend(cfg: TrainConfig) -> str | None:
    """ASP talks point-to-point with CPU tensors: gloo, whatever the workers' device."""
    return "gloo" if cfg.mode == "asp" else None

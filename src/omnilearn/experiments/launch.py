"""Start the workers: spawn ``--workers`` local processes, or join a torchrun group.

Local runs rendezvous through a file store in a private temp directory (no
port to pick or collide on). A worker that raises writes
``RUN_DIR/error-rank<R>.log`` (first line: when and what, then the
traceback); the launcher stops the others and reports, in one line, the
rank that failed first: later failures are usually peers losing it.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from dataclasses import dataclass
from typing import Callable, Sequence

import torch.multiprocessing as mp

from omnilearn.experiments.config import TrainConfig
from omnilearn.distributed import group


class WorkerFailed(RuntimeError):
    """A worker process died; the message names its rank and the cause."""


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


def _run_rank(join: Callable[[], group.DistContext], rank: int, jobs: Sequence[Job], log_dir: Path | None) -> None:
    try:
        ctx = join()
        for job in jobs:
            _run_job(job, ctx)
            group.barrier()  # move on together: rank 0 may still be writing the run directory
    except BaseException as e:
        if log_dir is not None:
            cause = traceback.format_exception_only(type(e), e)[-1].strip()
            (log_dir / f"error-rank{rank}.log").write_text(f"{time.time():.6f} {cause}\n{traceback.format_exc()}")
        raise
    finally:
        group.destroy()


def _spawned(local_rank: int, jobs: Sequence[Job], log_dir: Path, init_method: str) -> None:
    cfg = jobs[0].cfg

    def join() -> group.DistContext:
        n = processes(cfg)
        return group.init(local_rank, n, local_rank, n, cfg.device, cfg.timeout_s, init_method, _backend(cfg))

    _run_rank(join, local_rank, jobs, log_dir)


def first_failure(run_dir: Path) -> tuple[int, str] | None:
    """(rank, cause) of the earliest ``error-rank*.log`` in ``run_dir``."""
    found = []
    for log in run_dir.glob("error-rank*.log"):
        stamp, _, cause = log.read_text().partition("\n")[0].partition(" ")
        found.append((float(stamp), int(log.stem.removeprefix("error-rank")), cause))
    return min(found)[1:] if found else None


def run_local(jobs: Sequence[Job], log_dir: Path) -> None:
    """Spawn ``jobs[0].cfg.workers`` local workers once and run every job in them, in order."""
    store = tempfile.mkdtemp(prefix="omnilearn-store-")
    os.environ["OMNILEARN_RUN_ID"] = run = f"{os.getpid()}-{int(time.time())}"  # inherited by the workers
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)  # we report failures ourselves
    try:
        mp.start_processes(
            _spawned, args=(list(jobs), log_dir, f"file://{store}/store"), nprocs=processes(jobs[0].cfg), join=True,
            start_method="spawn",
        )
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        first = first_failure(log_dir)
        if first is None:
            raise WorkerFailed(f"worker rank {e.error_index} died ({e}); see the messages above") from None
        rank, cause = first
        raise WorkerFailed(f"worker rank {rank} failed: {cause} (traceback: {log_dir}/error-rank{rank}.log)") from None
    finally:
        shutil.rmtree(store, ignore_errors=True)
        if any(job.cfg.emulator == "cgroup" for job in jobs):
            _cleanup_cgroups(run)


def _cleanup_cgroups(run: str) -> None:
    """Remove the run's cgroups, also after a crash or Ctrl-C; a failure here is a warning, not the error."""
    from omnilearn.emulation.throttle import ThrottleError, cleanup_run

    try:
        cleanup_run(run)
    except ThrottleError as e:
        print(f"omnilearn: warning: {e}", file=sys.stderr)


def run_torchrun(jobs: Sequence[Job], log_dir: Path | None) -> None:
    """This process is one rank of a torchrun job; the run directories matter on rank 0 only."""
    cfg = jobs[0].cfg
    _run_rank(lambda: group.init_from_torchrun(cfg.device, cfg.timeout_s, _backend(cfg)), int(os.environ["RANK"]),
              jobs, log_dir)


def _backend(cfg: TrainConfig) -> str | None:
    """ASP talks point-to-point with CPU tensors: gloo, whatever the workers' device."""
    return "gloo" if cfg.mode == "asp" else None

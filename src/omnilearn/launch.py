"""Start the workers: spawn ``--workers`` local processes, or join a torchrun group.

Local runs rendezvous through a file store in a private temp directory (no
port to pick or collide on). A worker that raises writes
``RUN_DIR/error-rank<R>.log`` (first line: when and what, then the
traceback); the launcher stops the others and reports, in one line, the
rank that failed first: later failures are usually peers losing it.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable

import torch.multiprocessing as mp

from omnilearn.config import TrainConfig
from omnilearn.dist import group


class WorkerFailed(RuntimeError):
    """A worker process died; the message names its rank and the cause."""


def _run_rank(join: Callable[[], group.DistContext], rank: int, cfg: TrainConfig, run_dir: Path | None) -> dict | None:
    from omnilearn.trainer import BSPTrainer

    try:
        ctx = join()
        summary = BSPTrainer(cfg, ctx, run_dir if ctx.is_main else None).fit()
        group.barrier()  # leave together: rank 0 may still be writing the run directory
        return summary
    except BaseException as e:
        if run_dir is not None:
            cause = traceback.format_exception_only(type(e), e)[-1].strip()
            (run_dir / f"error-rank{rank}.log").write_text(f"{time.time():.6f} {cause}\n{traceback.format_exc()}")
        raise
    finally:
        group.destroy()


def _spawned(local_rank: int, cfg: TrainConfig, run_dir: Path, init_method: str) -> None:
    def join() -> group.DistContext:
        return group.init(local_rank, cfg.workers, local_rank, cfg.workers, cfg.device, cfg.timeout_s, init_method)

    _run_rank(join, local_rank, cfg, run_dir)


def first_failure(run_dir: Path) -> tuple[int, str] | None:
    """(rank, cause) of the earliest ``error-rank*.log`` in ``run_dir``."""
    found = []
    for log in run_dir.glob("error-rank*.log"):
        stamp, _, cause = log.read_text().partition("\n")[0].partition(" ")
        found.append((float(stamp), int(log.stem.removeprefix("error-rank")), cause))
    return min(found)[1:] if found else None


def run_local(cfg: TrainConfig, run_dir: Path) -> None:
    store = tempfile.mkdtemp(prefix="omnilearn-store-")
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)  # we report failures ourselves
    try:
        mp.start_processes(
            _spawned, args=(cfg, run_dir, f"file://{store}/store"), nprocs=cfg.workers, join=True,
            start_method="spawn",
        )
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        first = first_failure(run_dir)
        if first is None:
            raise WorkerFailed(f"worker rank {e.error_index} died ({e}); see the messages above") from None
        rank, cause = first
        raise WorkerFailed(f"worker rank {rank} failed: {cause} (traceback: {run_dir}/error-rank{rank}.log)") from None
    finally:
        shutil.rmtree(store, ignore_errors=True)


def run_torchrun(cfg: TrainConfig, run_dir: Path | None) -> dict | None:
    """This process is one rank of a torchrun job; ``run_dir`` matters on rank 0 only."""
    import os

    return _run_rank(lambda: group.init_from_torchrun(cfg.device, cfg.timeout_s), int(os.environ["RANK"]), cfg, run_dir)

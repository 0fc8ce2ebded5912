"""Start the workers: spawn ``--workers`` local processes, or join a torchrun group.

Local runs rendezvous through a file store in a private temp directory (no
port to pick or collide on). A worker that raises writes its traceback to
``RUN_DIR/error-rank<R>.log``; the launcher stops the others and reports one
line naming the rank.
"""

from __future__ import annotations

import shutil
import tempfile
import traceback
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

from omnilearn.config import TrainConfig
from omnilearn.dist import group


class WorkerFailed(RuntimeError):
    """A worker process died; the message names its rank and the cause."""


def _run_rank(ctx: group.DistContext, cfg: TrainConfig, run_dir: Path | None) -> dict | None:
    from omnilearn.trainer import BSPTrainer

    try:
        summary = BSPTrainer(cfg, ctx, run_dir if ctx.is_main else None).fit()
        dist.barrier()  # leave together: rank 0 may still be writing the run directory
        return summary
    except BaseException:
        if run_dir is not None:
            (run_dir / f"error-rank{ctx.rank}.log").write_text(traceback.format_exc())
        raise
    finally:
        group.destroy()


def _spawned(local_rank: int, cfg: TrainConfig, run_dir: Path, init_method: str) -> None:
    ctx = group.init(local_rank, cfg.workers, local_rank, cfg.workers, cfg.device, cfg.timeout_s, init_method)
    _run_rank(ctx, cfg, run_dir)


def run_local(cfg: TrainConfig, run_dir: Path) -> None:
    store = tempfile.mkdtemp(prefix="omnilearn-store-")
    try:
        mp.start_processes(
            _spawned, args=(cfg, run_dir, f"file://{store}/store"), nprocs=cfg.workers, join=True,
            start_method="spawn",
        )
    except mp.ProcessRaisedException as e:
        cause = [line for line in str(e).strip().splitlines() if line.strip()][-1]
        raise WorkerFailed(
            f"worker rank {e.error_index} failed: {cause} (traceback: {run_dir}/error-rank{e.error_index}.log)"
        ) from None
    except mp.ProcessExitedException as e:
        raise WorkerFailed(f"worker rank {e.error_index} exited with code {e.exit_code}") from None
    finally:
        shutil.rmtree(store, ignore_errors=True)


def run_torchrun(cfg: TrainConfig, run_dir: Path | None) -> dict | None:
    """This process is one rank of a torchrun job; ``run_dir`` matters on rank 0 only."""
    ctx = group.init_from_torchrun(cfg.device, cfg.timeout_s)
    return _run_rank(ctx, cfg, run_dir)

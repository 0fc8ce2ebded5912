"""``omnilearn train --mode asp``: the harness side of ASP. Builds the workload, runs the library's runtime.

Rank 0 becomes a :class:`~omnilearn.asp.server.ParameterServer` (model,
optimizer and rate schedule from the :class:`TrainConfig`, one evaluation
over the test split per epoch of data), ranks 1..n
:class:`~omnilearn.asp.worker.ASPWorker` s on the same model and training
set. The schedule counts push slots: ``n`` of them are one step of ``B``
samples (a push is one slot while every worker is live). The server saves
checkpoints in ``RUN_DIR/checkpoints`` every ``--checkpoint-every`` steps;
with ``--resume`` it continues from the newest (workers need nothing: they
pull the weights). ``OMNILEARN_FAULT_KILL_AT`` (tests:
:mod:`omnilearn.asp.faults`) is obeyed in a run that is not a resume, so a
restarted run goes past it.

Run its tests: ``python -m pytest -q tests/dist/test_asp_server.py tests/faults/test_asp_faults.py``
"""

from __future__ import annotations

from pathlib import Path

import torch

from omnilearn.asp.faults import kill_point
from omnilearn.asp.server import ParameterServer
from omnilearn.asp.settings import ASPSettings
from omnilearn.asp.worker import ASPWorker, worker_device
from omnilearn.checkpoint import CheckpointStore
from omnilearn.distributed.group import DistContext
from omnilearn.experiments.train import workload
from omnilearn.experiments.config import TrainConfig
from omnilearn.experiments.datasets.core import Splits

SERVER_ALONE = DistContext(0, 1, 0, 1, torch.device("cpu"), "none")  # the server evaluates alone, on the CPU


def train_asp(cfg: TrainConfig, ctx: DistContext, run_dir: Path | None) -> dict | None:
    """Serve (rank 0, returns the summary) or work (ranks 1..n, returns None)."""
    splits = workload.load_data(cfg)
    if ctx.rank == 0:
        server = build_server(cfg, run_dir, splits)
        if cfg.resume:
            server.resume()
        return server.serve()
    build_worker(cfg, ctx, splits).run()
    return None


def asp_settings(cfg: TrainConfig) -> ASPSettings:
    return ASPSettings(cfg.lr_scaling, cfg.staleness_lr, cfg.max_time_s, cfg.checkpoint_every, cfg.max_staleness)


def build_server(cfg: TrainConfig, run_dir: Path | None, splits: Splits | None = None) -> ParameterServer:
    """The parameter server of ``cfg``'s workload (``splits``: the loaded data, loaded here when None)."""
    splits = splits if splits is not None else workload.load_data(cfg)
    run = workload.resolve(cfg, len(splits.train))
    pushes, pushes_per_epoch = run.total_steps * cfg.workers, run.steps_per_epoch * cfg.workers
    model = workload.build_model(cfg, splits)
    opt = workload.make_optimizer(cfg, model.parameters())
    schedule = workload.make_schedule(cfg, opt, pushes, pushes_per_epoch)
    test = splits.test

    def evaluate(net: torch.nn.Module) -> tuple[float, float]:
        return workload.evaluate(net, test, SERVER_ALONE)

    store = CheckpointStore(run_dir / "checkpoints", keep=cfg.keep_checkpoints) if run_dir is not None else None
    return ParameterServer(model, opt, schedule, dataset_len=len(splits.train), cfg=cfg, settings=asp_settings(cfg),
                           run=run, evaluate=evaluate, run_dir=run_dir, checkpoints=store,
                           fault=None if cfg.resume else kill_point(0))


def build_worker(cfg: TrainConfig, ctx: DistContext, splits: Splits | None = None) -> ASPWorker:
    """Worker ``ctx.rank`` of ``cfg``'s workload, on its own device."""
    splits = splits if splits is not None else workload.load_data(cfg)
    return ASPWorker(workload.build_model(cfg, splits), splits.train, workload.criterion,
                     device=worker_device(cfg.device, ctx), max_batch=cfg.upper_batch, timeout_s=cfg.timeout_s,
                     fault=None if cfg.resume else kill_point(ctx.rank))

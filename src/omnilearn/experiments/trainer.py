"""``omnilearn train``'s training loop, written on the public API (:mod:`omnilearn.bsp.session`).

Per rank: load the workload (``workload.py``), open a :class:`Session`, and
run the loop any user of the API would write — the session's loader serves
this rank's slice of each global batch (as ``accumulation_steps``
micro-batches when that is above 1), ``backward()`` weights each
micro-batch, ``step()`` ends the optimizer step and feeds the controller.
One evaluation over the test split per epoch.

Run: ``python -m pytest -q tests/dist/test_bsp.py``
"""

from __future__ import annotations

from pathlib import Path

from omnilearn.bsp.session import Session
from omnilearn.distributed.group import DistContext
from omnilearn.experiments import workload
from omnilearn.experiments.config import TrainConfig
from omnilearn.experiments.datasets import core as data
from omnilearn.experiments.workload import PREFETCH_FACTOR, resolve


class BSPTrainer:
    def __init__(self, cfg: TrainConfig, ctx: DistContext, run_dir: Path | None) -> None:
        self.cfg, self.ctx = cfg, ctx
        splits = workload.load_data(cfg)
        self.test = splits.test
        self.run = resolve(cfg, len(splits.train))
        self.session = Session(cfg, ctx, run_dir, self.run.total_steps)
        self.loader = self.session.data_loader(
            splits.train, num_workers=cfg.loader_workers, collate_fn=data.keep_batch,
            prefetch_factor=PREFETCH_FACTOR if cfg.loader_workers > 0 else None,
        )
        self.model = self.session.wrap_model(workload.build_model(cfg, splits))
        self.opt = workload.make_optimizer(cfg, self.model.parameters())
        self.lr_sched = workload.make_schedule(cfg, self.opt, self.run.total_steps, self.run.steps_per_epoch)

    def fit(self) -> dict | None:
        try:
            for epoch in range(self.run.epochs):
                self.loader.set_epoch(epoch)
                for batch in self.loader:
                    self._step(batch if self.cfg.accumulation_steps > 1 else [batch])
                with self.session.paused():
                    self.session.sync_buffers()
                    loss, accuracy = workload.evaluate(self.session.module, self.test, self.ctx)
                self.session.log_eval(loss, accuracy, epoch)
            return self.session.finish()
        finally:
            self.session.release()

    def _step(self, micro_batches: list) -> None:
        self.opt.zero_grad(set_to_none=True)
        for x, y in micro_batches:
            x, y = x.to(self.ctx.device, non_blocking=True), y.to(self.ctx.device, non_blocking=True)
            self.session.backward(workload.criterion(self.model(x), y))
        lr = self.opt.param_groups[0]["lr"]
        self.opt.step()
        self.lr_sched.step()
        self.session.step(lr=lr)

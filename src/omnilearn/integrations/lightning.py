"""PyTorch Lightning: ``Trainer(strategy=OmniLearnStrategy(...))`` trains a ``LightningModule`` balanced.

    from omnilearn.integrations.lightning import OmniLearnStrategy
    trainer = pl.Trainer(strategy=OmniLearnStrategy(global_batch=256, speeds="3,1"), accelerator="cpu",
                         devices=2, max_steps=500, use_distributed_sampler=False)

The strategy is Lightning's DDP strategy with OmniLearn's session inside
(:func:`omnilearn.setup` joins the process group Lightning made):

- the model is wrapped by ``Session.wrap_model`` (DDP with the weighted
  gradient hook: the update is the global batch's mean gradient);
- the training dataloader's dataset (and ``collate_fn``, ``num_workers``)
  goes into ``Session.data_loader``: each step hands this worker its share
  ``b_i`` of the global batch (Lightning's batch size is ignored; validation
  loaders stay Lightning's);
- after each optimizer step the session's ``step(loss)`` ends the step;
  every control interval the controller may move batches; each worker's
  batch is logged to Lightning's loggers as ``omnilearn/batch_rank<i>``;
- ``finish()`` at the end of fit writes the summary (rank 0) and, with
  ``out=``, the run directory;
- teardown: Lightning keeps its process group after fit (``trainer.test()``
  may follow); OmniLearn destroys it when the process exits, before the
  interpreter finalises, after the model let go of it
  (:func:`omnilearn.distributed.group.destroy`), so no gloo thread is left
  to abort the exit.

Settings are :func:`omnilearn.setup` keywords (``global_batch`` or
``local_batch``, ``speeds``, ``controller``, ``control_interval``, ``out``...);
``total_steps`` is the Trainer's ``max_steps``. Pass
``use_distributed_sampler=False`` to the Trainer (OmniLearn's sampler
replaces Lightning's). Not supported yet: gradient accumulation (Lightning's
``accumulate_grad_batches`` is refused with a one-line error, and
``accumulation_steps`` is not wired here), checkpoints of the session
through Lightning's checkpoint hooks, and Fabric.

Run: ``python -m pytest -q tests/examples/test_lightning_example.py``
"""

from __future__ import annotations

from typing import Any

try:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.trainer.states import RunningStage
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("omnilearn.integrations.lightning needs PyTorch Lightning: pip install lightning") from e

import omnilearn
from omnilearn.config import ConfigError


class _StepReporter(pl.Callback):
    """Ends OmniLearn's step after each training batch and logs the per-worker batches."""

    def __init__(self, strategy: "OmniLearnStrategy") -> None:
        self.strategy = strategy

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        session = self.strategy.session
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        session.step(loss)
        if trainer.logger is not None and session.is_main:
            metrics = {f"omnilearn/batch_rank{r}": float(b) for r, b in enumerate(session.batches)}
            trainer.logger.log_metrics(metrics, step=trainer.global_step)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.strategy.summary = self.strategy.session.finish()


class OmniLearnStrategy(DDPStrategy):
    """Lightning's DDP strategy with OmniLearn's balanced batches, weighted gradients and controller."""

    strategy_name = "omnilearn"

    def __init__(self, **settings: Any) -> None:
        super().__init__()
        self.settings = settings
        self.session = None
        self.summary: dict | None = None

    def setup(self, trainer: pl.Trainer) -> None:
        if trainer.accumulate_grad_batches != 1:
            raise ConfigError(f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) is not supported "
                              "by OmniLearnStrategy; drop it (the global batch is per optimizer step)")
        if trainer.state.fn == "fit" and self.session is None:
            steps = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
            device = "cuda" if self.root_device.type == "cuda" else "cpu"
            self.session = omnilearn.setup(total_steps=steps, device=device, **self.settings)
            trainer.callbacks.append(_StepReporter(self))
        super().setup(trainer)

    def _setup_model(self, model):
        return self.session.wrap_model(model)

    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if self.session is None or trainer is None or trainer.state.stage != RunningStage.TRAINING:
            return dataloader
        if self.session.loader is not None:
            return self.session.loader
        return self.session.data_loader(dataloader.dataset, num_workers=dataloader.num_workers,
                                        collate_fn=dataloader.collate_fn)

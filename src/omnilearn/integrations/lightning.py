"""PyTorch Lightning: ``Trainer(strategy=OmniLearnStrategy(...))`` trains a ``LightningModule`` balanced.

    from omnilearn.integrations.lightning import OmniLearnStrategy
    trainer = pl.Trainer(strategy=OmniLearnStrategy(global_batch=256, speeds="3,1"), accelerator="cpu",
                         devices=2, max_steps=500, accumulate_grad_batches=2)
    trainer.fit(model, train_loader, val_loader)            # ckpt_path=... resumes data and controller too

Lightning's DDP strategy with an OmniLearn session inside, one per ``fit()``
(:func:`omnilearn.setup` joins the group Lightning made). Per fit:

- the model is wrapped by ``Session.wrap_model`` (DDP with the weighted
  gradient hook; DDP keyword arguments given to the strategy reach it);
- the batch: ``global_batch``/``local_batch`` if given, else the training
  ``DataLoader``'s ``batch_size`` x ``accumulate_grad_batches`` per process,
  as DDP would train (:mod:`omnilearn.integrations.lightning_session`);
- the training ``DataLoader`` is rebuilt by ``Session.data_loader`` with its own settings
  (:mod:`omnilearn.integrations.lightning_data`): each step hands this worker its share ``b_i``; validation and
  test are sharded, disjoint, over the ranks; predict by Lightning itself, as under ``DDPStrategy``. The
  Trainer's ``use_distributed_sampler=False`` leaves evaluation loaders as they are;
- ``Trainer(accumulate_grad_batches=K)`` becomes the session's exact accumulation: each optimizer step is ``K``
  micro-batches of the worker's share; ``backward`` goes through ``Session.backward`` (the weight ``m_ij/b_i``,
  the sync on the last micro-batch only; Lightning's ``1/K`` loss scaling undone first);
- after each optimizer step ``Session.step()``: the session's step count
  is Lightning's ``global_step`` (checked every step); every control
  interval the controller may move batches; rank 0 logs each worker's batch
  as ``omnilearn/batch_rank<i>``;
- validation inside fit sees equal BatchNorm statistics on every rank
  (``Session.sync_buffers()`` first, unless a control interval just ended)
  and is left out of the training time and of the next step's compute;
- checkpoints: ``ol.state_dict()`` (every rank's part, gathered on rank 0)
  rides in Lightning's checkpoint under ``"omnilearn"``; ``fit(ckpt_path=...)``
  loads it into the new session, so data, controller and step count continue
  where they stopped (at another world size too: the split is re-planned);
  one saved with another seed, dataset length or steps per epoch is refused
  in one line naming the strategy's keyword. Rank 0 writes it as Lightning serializes it, atomically beside
  the target (:mod:`~omnilearn.integrations.lightning_save`: the old file or the new one, never a cut one), for
  a local path with Lightning's default checkpoint IO (a ``checkpoint_io`` plugin, or a remote URL: Lightning's
  own write);
- ``on_train_end``: ``Session.finish()`` (``strategy.summary`` on rank 0;
  with ``out=``, the run directory); teardown releases the wrapped model;
- a second ``fit()`` on the same Trainer continues the run (its session
  loads the previous one's state); a new Trainer starts afresh. A fit that
  continues a run (a checkpoint, or the previous fit) appends to the run
  directory ``out`` already holds, as ``omnilearn train --resume`` does.

- a peer that dies: a survivor writes the last completed step as the
  Trainer's ``OnExceptionCheckpoint`` file, without collectives, and
  ``fit(ckpt_path="last")`` resumes it (:mod:`omnilearn.integrations.lightning_rescue`).

Refused in one line (:mod:`omnilearn.integrations.lightning_options`; docs/lightning.md lists every flag, honoured
or refused): DDP comm hooks and model averaging, buffer broadcasting, the Trainer's own keywords given to the
strategy, DDP's ``mixed_precision`` and delayed all-reduce, ``16-mixed``, ``sync_batchnorm``, the
``limit_train_batches`` family, several optimizers, an overridden ``backward``, a changing
``accumulate_grad_batches``, a checkpoint without OmniLearn's state, Lightning versions outside the tested range.
Lightning handles SIGTERM (``handle_signals=False`` unless given; its handler cannot raise a lost peer's error).
Custom loops: Lightning Fabric's :class:`~omnilearn.integrations.lightning_fabric.OmniLearnFabricStrategy`; the guide is docs/lightning.md.

Run: ``python -m pytest -q tests/dist/test_lightning_strategy.py tests/dist/test_lightning_exact.py
tests/dist/test_lightning_trust.py tests/dist/test_lightning_resume.py tests/unit/test_lightning_private_names.py
tests/examples/test_lightning_example.py tests/faults/test_rescue_lightning.py tests/dist/test_lightning_atomic.py``
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

try:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.trainer.states import RunningStage, TrainerFn
    from lightning.pytorch.utilities.model_helpers import is_overridden
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("omnilearn.integrations.lightning needs PyTorch Lightning: pip install lightning") from e

import omnilearn
from omnilearn.bsp.checkpointing import gathered_state
from omnilearn.bsp.wrap import release
from omnilearn.config import ConfigError
from omnilearn.integrations.lightning_data import evaluation_loader, training_loader
from omnilearn.integrations import lightning_rescue
from omnilearn.integrations.lightning_save import local_target, write_local
from omnilearn.integrations.lightning_options import refuse_sharded, refuse_trainer_flags, split_options
from omnilearn.integrations.lightning_session import continued_run, join_round_group, load_resumed, with_loader_batch
from omnilearn.versions import require_tested

STATE_KEY = "omnilearn"  # the session's state in a Lightning checkpoint


class _BatchLogger(pl.Callback):
    """After each optimizer step: the one-step-counter check, and each worker's batch to Lightning's logger."""

    def __init__(self, strategy: "OmniLearnStrategy") -> None:
        self.strategy, self.logged, self.rescuing = strategy, -1, False

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.logged = self.strategy.session.steps_done
        self.rescuing = self.strategy.boundary.track(trainer, self.strategy.world_size)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        session = self.strategy.session
        if session.steps_done == self.logged:
            return  # a micro-batch before the optimizer step
        self.logged = session.steps_done
        if session.steps_done != trainer.global_step:
            raise RuntimeError(f"OmniLearn's session is at step {session.steps_done} but trainer.global_step is "
                               f"{trainer.global_step}: one Session.step() per optimizer step was broken")
        if self.rescuing:  # what a survivor's save holds of Lightning's loop (lightning_rescue)
            self.strategy.boundary.mark(trainer, session.steps_done)
        if trainer.logger is not None and session.is_main:
            metrics = {f"omnilearn/batch_rank{r}": float(b) for r, b in enumerate(session.batches)}
            trainer.logger.log_metrics(metrics, step=trainer.global_step)


class OmniLearnStrategy(lightning_rescue.SurvivorSave, DDPStrategy):
    """Lightning's DDP strategy with OmniLearn's balanced batches, weighted gradients and controller."""

    strategy_name = "omnilearn"

    def __init__(self, **options: Any) -> None:
        lightning, ddp_kwargs, settings = split_options(options)
        super().__init__(**lightning, **ddp_kwargs)
        settings.setdefault("handle_signals", False)  # Lightning's own SIGTERM handling stops the Trainer
        self.settings = settings
        self.session = None
        self.summary: dict | None = None
        self._resume_state: dict | None = None  # the session state of the checkpoint fit(ckpt_path=) loads
        self._last_state: dict | None = None  # the previous fit's session state (a second fit continues it)
        self._carry: dict | None = None  # the state the next training loader's session loads
        self._paused = None
        self._sampler_choice: tuple[int, bool] | None = None  # (the Trainer, its use_distributed_sampler)
        self.boundary = lightning_rescue.Boundary()  # the fit loop at the last step's end: a survivor saves it

    @property
    def evaluation_sharded(self) -> bool:
        """The Trainer's ``use_distributed_sampler``: True shards validation, test and predict over the ranks."""
        return self._sampler_choice is None or self._sampler_choice[1]

    # --- the session's life: one per fit ---------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer) -> None:
        require_tested("lightning", door="OmniLearnStrategy")
        connector = trainer._accelerator_connector
        if self._sampler_choice is None or self._sampler_choice[0] != id(trainer):
            self._sampler_choice = (id(trainer), connector.use_distributed_sampler)  # the user's, read once
        # predict: Lightning shards it itself, as under DDPStrategy; training and evaluation: OmniLearn (docstring)
        connector.use_distributed_sampler = self.evaluation_sharded and trainer.state.fn == TrainerFn.PREDICTING
        if trainer.state.fn == TrainerFn.FITTING:
            refuse_trainer_flags(trainer, self)
            self._open_session(trainer)
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            self._check_fit()

    def setup_distributed(self) -> None:
        join_round_group(self)  # under torchrun: a group per round, so a restart re-forms it (lightning_session)
        super().setup_distributed()

    def _open_session(self, trainer: pl.Trainer) -> None:
        carry, self._resume_state = self._resume_state, None
        if carry is None and trainer.global_step > 0:
            carry = self._last_state  # a second fit on this Trainer continues the run (checked at train start)
        settings, run_dir = continued_run(self.settings, carry)
        settings = with_loader_batch(settings, trainer.fit_loop._data_source.dataloader,
                                     trainer.accumulate_grad_batches, "OmniLearnStrategy")
        steps = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        device = "cuda" if self.root_device.type == "cuda" else "cpu"
        self.session = omnilearn.setup(total_steps=steps, device=device,
                                       accumulation_steps=trainer.accumulate_grad_batches, **settings)
        if run_dir is not None and self.session.is_main:
            self.session.run_dir = run_dir  # rank 0's record appends there (a ``resume`` event first)
        self.session.rescue_with(lambda step: self._rescue(step, STATE_KEY))  # a lost peer: lightning_rescue
        self._carry, self.summary = carry, None
        if not any(isinstance(c, _BatchLogger) and c.strategy is self for c in trainer.callbacks):
            trainer.callbacks.append(_BatchLogger(self))

    def _check_fit(self) -> None:
        module = self.lightning_module
        if len(self.optimizers) != 1:
            raise ConfigError(f"configure_optimizers() returned {len(self.optimizers)} optimizers: OmniLearnStrategy "
                              "takes one (one OmniLearn step per optimizer step)")
        if is_overridden("backward", module):
            raise ConfigError(f"{type(module).__name__}.backward() is overridden: OmniLearnStrategy does each "
                              "backward itself (Session.backward weights it); drop the override")

    def _setup_model(self, model):
        refuse_sharded(model, "OmniLearnStrategy (Lightning's DDP strategy)")
        return self.session.wrap_model(model, **self._ddp_kwargs)

    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer
        if trainer.state.stage == RunningStage.TRAINING:
            loader = training_loader(self.session, dataloader)
            if self._carry is not None:
                carry, self._carry = self._carry, None
                load_resumed(self.session, carry, "OmniLearnStrategy")  # after wrap_model and data_loader
            return loader
        if not self.evaluation_sharded or trainer.state.stage == RunningStage.PREDICTING:
            return dataloader  # left as the user made it, or sharded by Lightning (predict)
        return evaluation_loader(dataloader, self.global_rank, self.world_size, trainer.state.stage)

    def on_train_start(self) -> None:
        super().on_train_start()
        self._shield_sigterm()  # Lightning's SIGTERM handler cannot cut a step once a peer is gone (lightning_rescue)
        trainer = self.lightning_module.trainer
        if self.session.steps_done != trainer.global_step:
            raise ConfigError(f"trainer.global_step is {trainer.global_step} but OmniLearn's session is at step "
                              f"{self.session.steps_done}: the checkpoint holds no '{STATE_KEY}' state (saved without "
                              "OmniLearnStrategy?); resume from a checkpoint OmniLearnStrategy wrote")

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        k, trainer = self.session.cfg.accumulation_steps, self.lightning_module.trainer
        if trainer.accumulate_grad_batches != k:
            raise ConfigError(f"accumulate_grad_batches changed to {trainer.accumulate_grad_batches} during fit (a "
                              f"GradientAccumulationScheduler?): OmniLearn's exact accumulation is fixed per fit at "
                              f"{k}")

    def on_train_end(self) -> None:
        self._last_state = self.session.state_dict()
        self.summary = self.session.finish()
        if self.session.is_main:  # the fit completed: an earlier attempt's survivors are done with their lock file
            lightning_rescue.sweep_lock(self.lightning_module.trainer)
        super().on_train_end()

    def teardown(self) -> None:
        model = self.session.model if self.session is not None else None
        super().teardown()
        release(model)  # the wrapped model lets go of the group: a later fit wraps the module anew

    # --- the step: backward through the session, Session.step() after the optimizer's ----------------------
    def backward(self, closure_loss, optimizer, *args: Any, **kwargs: Any):
        if not self._training():
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        if args or kwargs:
            raise ConfigError(f"backward arguments {args or ''}{kwargs or ''} are not supported by OmniLearnStrategy "
                              "(Session.backward takes the loss only); drop them")
        module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        k = self.session.cfg.accumulation_steps  # Lightning divided the loss by k; the session weights it exactly
        self.session.backward(closure_loss * k if k > 1 else closure_loss)
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    def block_backward_sync(self):
        """The session decides which micro-batch syncs (``model.no_sync()`` is refused on an OmniLearn model)."""
        return nullcontext()

    def optimizer_step(self, optimizer, closure, model=None, **kwargs: Any) -> Any:
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._training():
            lr = optimizer.param_groups[0].get("lr")
            self.session.step(lr=float(lr) if lr is not None else None)
        return out

    def _training(self) -> bool:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        return self.session is not None and trainer is not None and trainer.state.stage == RunningStage.TRAINING

    # --- validation inside fit: not training time ----------------------------------------------------------
    def on_validation_start(self) -> None:
        super().on_validation_start()
        if self.session is not None and self.lightning_module.trainer.state.fn == TrainerFn.FITTING:
            self._paused = self.session.paused()
            self._paused.__enter__()
            if self.session.loader is not None and not self.session.interval_ended:
                self.session.sync_buffers()  # BatchNorm statistics equal on every rank first (as at a checkpoint)

    def on_validation_end(self) -> None:
        if self._paused is not None:
            self._paused.__exit__(None, None, None)
            self._paused = None
            if self.session.ledger.open is not None:
                self.session.timer.begin()  # the step fetched ahead: its compute starts after the validation
        super().on_validation_end()

    # --- checkpoints: the session's state rides in Lightning's ---------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        """Every rank calls it (``Trainer.save_checkpoint``): the session's state, every rank's part, on rank 0,
        which writes the file (:func:`~omnilearn.integrations.lightning_save.write_local`, else Lightning's
        checkpoint IO). After a lost peer, nothing (the survivors saved already; this save's collectives would
        fail)."""
        if self._peer_lost():
            return
        if self.session is not None and self.session.loader is not None:
            if not self.session.interval_ended and self.session.model is not None:
                self.session.sync_buffers()
                checkpoint["state_dict"] = self.lightning_module_state_dict()
            checkpoint[STATE_KEY] = gathered_state(self.session)
        target = local_target(self.checkpoint_io, filepath, storage_options) if self.is_global_zero else None
        if target is None:
            super().save_checkpoint(checkpoint, filepath, storage_options)
        else:
            write_local(target, checkpoint)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            self._resume_state = checkpoint.get(STATE_KEY)
        return checkpoint


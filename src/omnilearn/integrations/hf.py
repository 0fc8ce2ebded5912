"""Hugging Face ``transformers.Trainer``: ``OmniLearnTrainer`` is a drop-in ``Trainer`` that trains balanced.

    from omnilearn.integrations.hf import OmniLearnTrainer
    trainer = OmniLearnTrainer(model=model, args=args, train_dataset=train, eval_dataset=test,
                               omnilearn=dict(speeds="3,1", out="runs/hf"))   # omnilearn.setup() keywords
    trainer.train()                       # torchrun --nproc-per-node N script.py, or one process

A subclass, not a callback: a callback sees the loop but cannot replace
what is wrong in it (the DDP wrap, the sampler, the loss scaling), and a
wrapper function would return a subclass anyway. What it changes in Trainer:

- **Session**: :func:`omnilearn.setup` joins the group accelerate made from
  torchrun's environment (or runs as one process). The global batch is
  Trainer's (``per_device_train_batch_size x gradient_accumulation_steps x
  world size``) unless ``omnilearn=dict(global_batch=B)`` says otherwise;
  ``accumulation_steps`` is ``gradient_accumulation_steps``.
- **Model and data**: ``_wrap_model`` is ``Session.wrap_model`` (DDP with the
  weighted gradient hook; accelerate then adds only autocast), and the
  training loader is ``Session.data_loader`` over ``train_dataset`` (with
  Trainer's collator and column removal), its ``K`` micro-batches per step
  handed to Trainer one by one. Evaluation stays Trainer's (accelerate
  shards it over the ranks, ``gather_for_metrics`` drops its padding).
- **Weighting**: ``training_step`` counts each micro-batch's loss terms with
  Trainer's own rule (labels ``!= -100``, shifted for causal LMs, also GPT-2
  whose config names no ``loss_type``), passes that count as
  ``num_items_in_batch`` (the model's loss is the micro-batch's mean), cancels Trainer's ``x world size`` of
  ``average_tokens_across_devices`` and calls ``Session.backward(loss,
  count=n)``: the update is the mean over every term of the global batch,
  whatever the split and either value of ``average_tokens_across_devices``.
  Without labels the weighting is by samples. Trainer's ``no_sync`` is
  left to the session (it sets DDP's sync flag per micro-batch itself).
- **Steps**: after each optimizer step ``Session.step`` ends the step (a
  callback's ``on_step_end``); the per-worker batches ride in every log as
  ``omnilearn/batch_rank<i>``; a stop signal agreed by the session stops
  Trainer after a checkpoint.
- **Checkpoints**: every ``save_steps`` checkpoint folder holds
  ``omnilearn_session.pt`` (:meth:`Session.state_dict` of every rank,
  gathered to rank 0), written last and atomically, before Trainer's
  ``save_total_limit`` rotation runs (:mod:`.hf_checkpoint`: complete or
  absent; ``save_on_each_node`` honoured); ``train(resume_from_checkpoint=...)``
  loads it (``True``: the newest complete folder), and the session's sampler
  continues the data where it stopped (Trainer's own batch skipping is
  turned off). Another world size resumes too (elastic).
- **Arguments** (:mod:`.hf_args`): Trainer's DDP keywords reach
  ``Session.wrap_model``, its seed (``data_seed``, else ``seed``) seeds the
  sampler; what cannot be honoured is refused in one line, as are an
  ``IterableDataset`` for training, a second ``train()`` on one trainer and a
  checkpoint without session state. docs/huggingface.md lists every field.

The private names of transformers and accelerate used here are pinned by
tests/unit/test_hf_private_names.py; versions outside ``TESTED`` are refused.

Run: ``python -m pytest -q tests/dist/test_hf_exact.py tests/dist/test_hf_trust.py tests/unit/test_hf_private_names.py``
"""

from __future__ import annotations

import contextlib
import itertools
import os
import warnings
from typing import Any, Iterator

import torch

try:
    from transformers import Trainer, TrainerCallback
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("omnilearn.integrations.hf needs transformers and accelerate: pip install 'transformers[torch]'"
                      ) from e

from omnilearn.bsp.setup import setup as setup_session
from omnilearn.config import ConfigError
from omnilearn.integrations import hf_checkpoint
from omnilearn.integrations.hf_args import ddp_kwargs, in_door_words, refusals, session_settings
from omnilearn.integrations.hf_checkpoint import SESSION_FILE
from omnilearn.versions import require_tested

__all__ = ["OmniLearnTrainer", "SESSION_FILE", "refusals"]


@contextlib.contextmanager
def _session_syncs(model: Any = None) -> Iterator[None]:
    """Replaces ``accelerator.no_sync``: the session turns DDP's sync off and on per micro-batch itself."""
    yield


class _MicroBatches:
    """The session's loader as Trainer iterates it: the ``K`` micro-batches of each step, one by one."""

    def __init__(self, session: Any) -> None:
        self.session, self.loader = session, session.loader
        self.k = session.cfg.accumulation_steps

    @property
    def dataset(self):
        return self.loader.dataset

    def __len__(self) -> int:
        """Micro-batches in a whole epoch (Trainer derives its steps per epoch and its epochs from it)."""
        return self.session.run.steps_per_epoch * self.k

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        for item in self.loader:
            yield from (item if self.k > 1 else (item,))


class _StepEnd(TrainerCallback):
    """Ends the session's step after each optimizer step; a stop signal stops Trainer after a checkpoint."""

    def __init__(self, trainer: "OmniLearnTrainer") -> None:
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        session = self.trainer.session
        session.step(lr=self.trainer._get_learning_rate())
        state.epoch = session.next_step / session.run.steps_per_epoch  # also right in a resumed epoch
        if session.should_stop:
            control.should_training_stop = control.should_save = True
        return control


class OmniLearnTrainer(Trainer):
    """``transformers.Trainer`` with OmniLearn's balanced batches, exact weighting and controller (module docstring)."""

    def __init__(self, *args: Any, omnilearn: dict | None = None, **kwargs: Any) -> None:
        require_tested("transformers", door="OmniLearnTrainer")
        require_tested("accelerate", door="OmniLearnTrainer")
        super().__init__(*args, **kwargs)
        bad = refusals(self.args)
        if bad:
            raise ConfigError(f"OmniLearnTrainer: {bad[0]}")
        self.session = setup_session(**session_settings(self.args, omnilearn))
        self.omnilearn_summary: dict | None = None
        self._session_state: dict | None = None  # loaded from a checkpoint, applied once the loader exists
        self._resumed_from: str | None = None
        self._trained = False
        self.accelerator.no_sync = _session_syncs
        self.add_callback(_StepEnd(self))

    # --- data and model -------------------------------------------------------------------------------------
    def get_train_dataloader(self) -> _MicroBatches:
        dataset = self.train_dataset
        if dataset is None:
            raise ValueError("OmniLearnTrainer.train() needs a train_dataset")
        if isinstance(dataset, torch.utils.data.IterableDataset):
            raise ConfigError(f"train_dataset is an IterableDataset ({type(dataset).__name__}): OmniLearnTrainer "
                              "needs a map-style dataset (len and __getitem__)")
        if self.session.loader is None:
            self._make_loader(dataset)
            self._restore_session()
        return _MicroBatches(self.session)

    def _make_loader(self, dataset) -> None:
        """``Session.data_loader`` with Trainer's collator, column removal and loader settings (hf_args)."""
        collator = self.data_collator
        if hasattr(dataset, "column_names") and hasattr(dataset, "remove_columns"):  # a datasets.Dataset
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="training")
        a = self.args
        self.session.data_loader(dataset, collate_fn=collator, num_workers=a.dataloader_num_workers,
                                 pin_memory=a.dataloader_pin_memory, prefetch_factor=a.dataloader_prefetch_factor)
        left = len(dataset) % self.session.global_batch
        if left and not a.dataloader_drop_last:
            warnings.warn(f"dataloader_drop_last=False: OmniLearn's sampler leaves out each epoch's last {left} of "
                          f"{len(dataset)} samples (the global batch is {self.session.global_batch}; the shuffle "
                          "changes every epoch); set dataloader_drop_last=True to say so", UserWarning, stacklevel=3)

    def _restore_session(self) -> None:
        """The checkpoint's session state, once the loader exists; a refusal names this door's keywords."""
        if self._session_state is None:
            return
        state, self._session_state = self._session_state, None
        try:
            self.session.load_state_dict(state)
        except (ConfigError, ValueError) as e:
            raise ConfigError(f"OmniLearnTrainer: resume_from_checkpoint={self._resumed_from}: "
                              f"{in_door_words(str(e))}") from None

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        if not training:
            return super()._wrap_model(model, training, dataloader)
        if self.session.model is None:  # with the DDP keywords Trainer gives accelerate (ddp_find_unused_parameters...)
            self.session.wrap_model(self.accelerator.unwrap_model(model), **ddp_kwargs(self._ddp_handler_kwargs()))
        wrapped = self.session.model
        if wrapped is self.model:  # one process: Trainer's accelerator.prepare() places it, as usual
            return wrapped
        return self.accelerator.prepare_model(wrapped, device_placement=False, evaluation_mode=True)  # autocast only

    def _ddp_handler_kwargs(self) -> dict:  # what Trainer made accelerate's DDP keywords
        return self.accelerator.ddp_handler.to_kwargs() if self.accelerator.ddp_handler is not None else {}

    # --- weighting ------------------------------------------------------------------------------------------
    def get_batch_samples(self, epoch_iterator, num_batches: int, device):
        """The step's micro-batches; no cross-rank count here: each micro-batch is counted in ``training_step``."""
        return list(itertools.islice(epoch_iterator, num_batches)), None

    def loss_terms(self, inputs: dict) -> torch.Tensor | None:
        """The terms the micro-batch's loss averages over, by Trainer's rule (None: weigh by samples)."""
        if not isinstance(inputs, dict) or "labels" not in inputs or not torch.is_tensor(inputs["labels"]):
            return None
        if torch.is_tensor(inputs.get("shift_labels")):
            labels = inputs["shift_labels"]
        else:
            labels = inputs["labels"][..., 1:] if self.loss_shifts_labels() else inputs["labels"]
        return labels.ne(-100).sum()

    def loss_shifts_labels(self) -> bool:
        """Trainer's rule, and also a causal LM whose config names no ``loss_type`` (GPT-2: Trainer misses it)."""
        model = self.accelerator.unwrap_model(self.model)
        causal = type(model).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
        return self._loss_shifts_labels or (causal and not getattr(model.config, "is_encoder_decoder", False))

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        inputs = self._prepare_inputs(inputs)
        count = self.loss_terms(inputs)
        passed = (self.model_accepts_loss_kwargs or self.compute_loss_func is not None) and count is not None
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=count.clamp(min=1) if passed else None)
        self.session.backward(loss, count=count)
        return loss.detach() / self.args.gradient_accumulation_steps  # for Trainer's log: this rank's mean

    def _get_num_items_in_batch(self, batch_samples: list, device) -> torch.Tensor | None:
        """This rank's count only (evaluation): each eval batch's loss is its own mean, as in one process."""
        if not batch_samples or (not self.model_accepts_loss_kwargs and self.compute_loss_func is None):
            return None
        counts = [self.loss_terms(batch) for batch in batch_samples]
        return None if None in counts else sum(counts).to(device)

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        """Trainer's loss over ``num_items_in_batch`` terms, without its ``x world size`` (OmniLearn weighs instead)."""
        result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if (self.args.average_tokens_across_devices and num_items_in_batch is not None
                and (self.model_accepts_loss_kwargs or self.compute_loss_func is not None)):
            factor = self.accelerator.num_processes // self.get_tp_size()  # what Trainer multiplied by
            return (result[0] / factor, result[1]) if return_outputs else result / factor
        return result

    # --- logs, evaluation, checkpoints ----------------------------------------------------------------------
    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if self.is_in_train and self.session.loader is not None:
            logs = {**logs, **{f"omnilearn/batch_rank{r}": float(b) for r, b in enumerate(self.session.batches)}}
        super().log(logs, *args, **kwargs)

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        if self.is_in_train and self.session.model is not None and not self.session.interval_ended:
            self.session.sync_buffers()  # BatchNorm statistics equal on every rank first
        return super().evaluate(*args, **kwargs)

    def _save_checkpoint(self, model, trial) -> None:
        """Trainer's folder, then the session file (its commit mark), then Trainer's rotation (module docstring of
        :mod:`omnilearn.integrations.hf_checkpoint`): a kill at any point leaves a complete checkpoint to resume."""
        if not self.session.interval_ended:
            self.session.sync_buffers()
        limit = self.args.save_total_limit
        run_dir = self._get_output_dir(trial=trial)
        folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")

        def trainer_folder() -> None:
            self.args.save_total_limit = None  # Trainer's rotation waits for the session file
            try:
                super(OmniLearnTrainer, self)._save_checkpoint(model, trial)
            finally:
                self.args.save_total_limit = limit

        hf_checkpoint.save(self.session, folder, trainer_folder, writer=self.args.should_save,
                           each_node=self.args.save_on_each_node,
                           prune=lambda: hf_checkpoint.rotate(run_dir, limit, keep=folder,
                                                              best=self.state.best_model_checkpoint))

    def _rescue(self, step: int) -> str:
        """A peer died (:mod:`omnilearn.bsp.rescue`): this rank writes ``checkpoint-<step>`` alone
        (:func:`~omnilearn.integrations.hf_checkpoint.rescue_trainer`)."""
        return hf_checkpoint.rescue_trainer(self, step)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        path = os.path.join(resume_from_checkpoint, SESSION_FILE)
        if not os.path.isfile(path):
            raise ConfigError(f"{resume_from_checkpoint} has no {SESSION_FILE} (not saved by OmniLearnTrainer, or cut "
                              "short mid-save): the data position is unknown; resume from a checkpoint "
                              "OmniLearnTrainer completed (resume_from_checkpoint=True finds the newest)")
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        self._resumed_from = resume_from_checkpoint
        self._session_state = torch.load(path, map_location="cpu", weights_only=True)

    # --- the run --------------------------------------------------------------------------------------------
    def _run_epoch(self, *args: Any, **kwargs: Any) -> None:
        kwargs["steps_trained_in_current_epoch"] = 0  # the session's sampler continues the data itself
        return super()._run_epoch(*args, **kwargs)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        if self._trained:
            raise RuntimeError("OmniLearnTrainer.train() was already called: one run per trainer (its session "
                               "holds the data position); make a new OmniLearnTrainer to train again")
        self._trained = True
        if resume_from_checkpoint is True:  # Trainer would take the newest folder, complete or not
            resume_from_checkpoint = hf_checkpoint.latest_complete(self.args.output_dir)
        hf_checkpoint.arm_rescue(self.session, self._rescue)  # a dead peer costs one step: a survivor saves a folder
        output = super().train(resume_from_checkpoint, *args, **kwargs)
        self.omnilearn_summary = self.session.finish()
        return output

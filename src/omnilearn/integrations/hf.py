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
  Trainer's own rule (labels ``!= -100``, shifted for causal LMs, also
  those like GPT-2 whose config names no ``loss_type``, which Trainer
  counts unshifted), passes
  that count as ``num_items_in_batch`` (so the model's loss is the
  micro-batch's mean), cancels Trainer's ``x world size`` of
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
  gathered to rank 0); ``train(resume_from_checkpoint=...)`` loads it, and
  the session's sampler continues the data where it stopped (Trainer's own
  batch skipping is turned off). Another world size resumes too (elastic).

Refused in one line: ``fp16`` (GradScaler), DeepSpeed, FSDP, several GPUs
per process, ``auto_find_batch_size``, ``group_by_length``,
``ignore_data_skip``, an ``IterableDataset`` for training, a second
``train()`` on one trainer, a checkpoint without session state.

Run: ``python -m pytest -q tests/dist/test_hf_exact.py tests/examples/test_hf_trainer.py``
"""

from __future__ import annotations

import contextlib
import itertools
import os
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
from omnilearn.bsp.checkpointing import gathered_state
from omnilearn.config import ConfigError

SESSION_FILE = "omnilearn_session.pt"  # in each checkpoint folder: the session state of every rank


def refusals(args: Any) -> list[str]:
    """The ``TrainingArguments`` OmniLearnTrainer cannot honour, each as a one-line reason with its fix."""
    bad = []
    if args.fp16:
        bad.append("fp16=True (its GradScaler scales the loss outside OmniLearn's weighting): use bf16=True or fp32")
    if getattr(args, "deepspeed", None):
        bad.append(f"deepspeed={args.deepspeed!r}: OmniLearn balances DDP only; drop deepspeed")
    if getattr(args, "fsdp", None):
        bad.append(f"fsdp={args.fsdp!r}: OmniLearn's Trainer wraps DDP only; drop fsdp, or for a sharded model "
                   "train it in your own loop with fully_shard and ol.wrap_model (docs/fsdp.md)")
    if args.n_gpu > 1:
        bad.append(f"{args.n_gpu} GPUs in one process (DataParallel): launch one process per GPU with torchrun")
    if args.auto_find_batch_size:
        bad.append("auto_find_batch_size=True: OmniLearn sets the batches; use omnilearn=dict(max_batch=...)")
    if getattr(args, "group_by_length", False):
        bad.append("group_by_length=True: OmniLearn's sampler replaces Trainer's; drop group_by_length")
    if args.ignore_data_skip:
        bad.append("ignore_data_skip=True: a resumed OmniLearn run always continues the data; drop it")
    return bad


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
        super().__init__(*args, **kwargs)
        bad = refusals(self.args)
        if bad:
            raise ConfigError(f"OmniLearnTrainer: {bad[0]}")
        settings = dict(omnilearn or {})
        k = self.args.gradient_accumulation_steps
        if settings.setdefault("accumulation_steps", k) != k:
            raise ConfigError(f"omnilearn=dict(accumulation_steps={settings['accumulation_steps']}) differs from "
                              f"gradient_accumulation_steps={k}: give gradient_accumulation_steps only")
        if "global_batch" not in settings:
            settings.setdefault("local_batch", self.args.per_device_train_batch_size * k)
        settings.setdefault("device", "cuda" if self.args.device.type == "cuda" else "cpu")
        steps = self.args.max_steps if self.args.max_steps > 0 else None
        self.session = setup_session(total_steps=settings.pop("total_steps", steps), **settings)
        self.omnilearn_summary: dict | None = None
        self._session_state: dict | None = None  # loaded from a checkpoint, applied once the loader exists
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
            collator = self.data_collator
            if hasattr(dataset, "column_names") and hasattr(dataset, "remove_columns"):  # a datasets.Dataset
                dataset = self._remove_unused_columns(dataset, description="training")
            else:
                collator = self._get_collator_with_removed_columns(collator, description="training")
            a = self.args
            self.session.data_loader(dataset, collate_fn=collator, num_workers=a.dataloader_num_workers,
                                     pin_memory=a.dataloader_pin_memory, prefetch_factor=a.dataloader_prefetch_factor)
            if self._session_state is not None:
                self.session.load_state_dict(self._session_state)
                self._session_state = None
        return _MicroBatches(self.session)

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        if not training:
            return super()._wrap_model(model, training, dataloader)
        if self.session.model is None:
            self.session.wrap_model(self.accelerator.unwrap_model(model))
        wrapped = self.session.model
        if wrapped is self.model:  # one process: Trainer's accelerator.prepare() places it, as usual
            return wrapped
        return self.accelerator.prepare_model(wrapped, device_placement=False, evaluation_mode=True)  # autocast only

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
        if not self.session.interval_ended:
            self.session.sync_buffers()
        super()._save_checkpoint(model, trial)
        state = gathered_state(self.session)  # a collective: every rank
        if not self.session.is_main or not self.args.should_save:
            return
        folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        tmp = os.path.join(folder, SESSION_FILE + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, os.path.join(folder, SESSION_FILE))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        path = os.path.join(resume_from_checkpoint, SESSION_FILE)
        if not os.path.isfile(path):
            raise ConfigError(f"{resume_from_checkpoint} has no {SESSION_FILE} (not saved by OmniLearnTrainer): "
                              "the data position is unknown; resume from a checkpoint OmniLearnTrainer wrote")
        super()._load_from_checkpoint(resume_from_checkpoint, model)
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
        output = super().train(resume_from_checkpoint, *args, **kwargs)
        self.omnilearn_summary = self.session.finish()
        return output

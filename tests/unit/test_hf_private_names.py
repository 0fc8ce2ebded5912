"""The private (and load-bearing public) names of transformers and accelerate that ``OmniLearnTrainer`` relies on.

``omnilearn.integrations.hf`` overrides or calls Trainer's private methods
and reads its attributes; each test here fails loudly, naming the name, when
one disappears or its parameters change, so a new transformers release is
caught by this file rather than by a silently wrong run. Tested with
transformers 5.24.0 and accelerate 1.15.0 (``omnilearn.versions.TESTED``).

Run: ``python -m pytest -q tests/unit/test_hf_private_names.py`` (a few seconds: it imports transformers).
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
from needs import needs

pytestmark = [needs("transformers", "hf"), needs("accelerate", "hf")]

# Trainer method -> the parameter names OmniLearnTrainer overrides it with or calls it by (in order, after self)
TRAINER_METHODS = {
    "_wrap_model": ["model", "training", "dataloader"],
    "_save_checkpoint": ["model", "trial"],
    "_load_from_checkpoint": ["resume_from_checkpoint", "model"],
    "_get_num_items_in_batch": ["batch_samples", "device"],
    "_remove_unused_columns": ["dataset", "description"],
    "_get_collator_with_removed_columns": ["data_collator", "description"],
    "_get_output_dir": ["trial"],
    "_get_learning_rate": [],
    "_prepare_inputs": ["inputs"],
    "get_tp_size": [],
    "get_batch_samples": ["epoch_iterator", "num_batches", "device"],
    "training_step": ["model", "inputs", "num_items_in_batch"],
    "compute_loss": ["model", "inputs", "return_outputs", "num_items_in_batch"],
    "compute_loss_context_manager": [],
    "get_train_dataloader": [],
    "log": ["logs", "start_time"],
}

# TrainingArguments fields the door reads, honours or refuses (hf_args, docs/huggingface.md)
ARGUMENT_FIELDS = [
    "fp16", "bf16", "deepspeed", "fsdp", "parallelism_config", "enable_jit_checkpoint",
    "ddp_find_unused_parameters", "ddp_bucket_cap_mb", "ddp_static_graph", "ddp_broadcast_buffers",
    "train_sampling_strategy", "dataloader_num_workers", "dataloader_pin_memory", "dataloader_prefetch_factor",
    "dataloader_persistent_workers", "dataloader_multiprocessing_context", "dataloader_in_order",
    "dataloader_drop_last", "auto_find_batch_size", "ignore_data_skip", "gradient_accumulation_steps",
    "per_device_train_batch_size", "seed", "data_seed", "max_steps", "save_total_limit", "save_on_each_node",
    "average_tokens_across_devices", "output_dir",
]


def parameters(function) -> list[str]:
    return [p for p in inspect.signature(function).parameters if p != "self"]


@pytest.mark.parametrize("name, expected", sorted(TRAINER_METHODS.items()))
def test_trainer_methods_keep_their_parameters(name, expected):
    from transformers import Trainer

    method = getattr(Trainer, name, None)
    assert method is not None, f"transformers.Trainer.{name} is gone: OmniLearnTrainer overrides or calls it"
    assert parameters(method)[: len(expected)] == expected, f"Trainer.{name}{inspect.signature(method)}"


def test_run_epoch_still_takes_the_batches_to_skip():
    from transformers import Trainer

    assert "steps_trained_in_current_epoch" in parameters(Trainer._run_epoch), inspect.signature(Trainer._run_epoch)


def test_trainer_attributes_the_door_reads_are_set():
    import torch
    from transformers import Trainer, TrainingArguments

    trainer = Trainer(model=torch.nn.Linear(2, 2), args=TrainingArguments(output_dir="unused", use_cpu=True,
                                                                          report_to=[]))
    for name in ("_loss_shifts_labels", "model_accepts_loss_kwargs", "compute_loss_func", "is_in_train"):
        assert hasattr(trainer, name), f"Trainer no longer sets {name}"
    handler = trainer.accelerator.ddp_handler  # Trainer's DDP keywords, which OmniLearnTrainer hands wrap_model
    assert handler is not None and handler.to_kwargs() == {"find_unused_parameters": True}, handler
    assert callable(trainer.accelerator.no_sync)  # replaced per instance by OmniLearnTrainer
    assert trainer.args.n_gpu <= 1 and isinstance(trainer.args.should_save, bool)


def test_training_arguments_keep_the_fields_the_door_reads():
    from transformers import TrainingArguments

    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    assert not set(ARGUMENT_FIELDS) - fields, f"TrainingArguments lost {sorted(set(ARGUMENT_FIELDS) - fields)}"
    assert "group_by_length" not in fields  # replaced by train_sampling_strategy="group_by_length" (refused)


def test_the_save_sequence_the_door_reorders_is_still_trainers():
    """The door holds rotation back by setting ``args.save_total_limit`` to None during ``_save_checkpoint``."""
    from transformers import Trainer
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, sort_checkpoints

    source = inspect.getsource(Trainer._save_checkpoint)
    assert "save_total_limit=self.args.save_total_limit" in source, "Trainer's rotation no longer reads args"
    assert 'f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"' in source, "checkpoint folders are named otherwise"
    assert "self._save_checkpoint(model, trial)" in inspect.getsource(Trainer._maybe_log_save_evaluate)
    assert PREFIX_CHECKPOINT_DIR == "checkpoint"
    assert parameters(sort_checkpoints)[:3] == ["output_dir", "checkpoint_prefix", "use_mtime"]
    assert "get_last_checkpoint(args.output_dir)" in inspect.getsource(Trainer.train)  # what resume=True meant


def test_accelerate_names_the_door_calls():
    from accelerate import Accelerator
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    assert parameters(Accelerator.prepare_model)[:3] == ["model", "device_placement", "evaluation_mode"]
    assert parameters(Accelerator.unwrap_model)[:1] == ["model"]
    assert "no_sync" in dir(Accelerator) and "num_processes" in dir(Accelerator)
    assert MODEL_FOR_CAUSAL_LM_MAPPING_NAMES["gpt2"] == "GPT2LMHeadModel"


def test_the_door_checks_the_tested_versions(monkeypatch):
    from omnilearn import versions
    from omnilearn.config import ConfigError
    from omnilearn.integrations.hf import OmniLearnTrainer

    monkeypatch.setitem(versions.TESTED, "transformers", ("0.1", "0.2"))
    monkeypatch.delenv(versions.ALLOW_ENV, raising=False)
    with pytest.raises(ConfigError, match="OmniLearnTrainer: transformers .* outside"):
        OmniLearnTrainer(model=None, args=None)


def test_the_folder_a_survivor_writes_is_the_one_trainer_reads():
    """hf_checkpoint.rescue_trainer writes Trainer's checkpoint files by name (it cannot call Trainer's save: that
    writes on the writer rank only, which may be the one that died); Trainer must still read those names, and the
    torchrun agent must still read the variable that gives each round a store of its own."""
    import transformers.trainer as trainer_module
    from transformers.utils import SAFE_WEIGHTS_NAME
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    source = inspect.getsource(trainer_module.Trainer)
    for name in ("OPTIMIZER_NAME", "SCHEDULER_NAME", "TRAINER_STATE_NAME", "SAFE_WEIGHTS_NAME"):
        assert name in source, f"Trainer no longer reads {name}"
    assert (trainer_module.OPTIMIZER_NAME, trainer_module.SCHEDULER_NAME, trainer_module.TRAINER_STATE_NAME,
            SAFE_WEIGHTS_NAME) == ("optimizer.pt", "scheduler.pt", "trainer_state.json", "model.safetensors")
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" in inspect.getsource(dynamic_rendezvous)

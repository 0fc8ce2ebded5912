"""The Hugging Face doors' shapes: ``OmniLearnTrainer`` (a ``transformers.Trainer``) and a custom ``accelerate`` loop.

:func:`train` (called in a rank of :mod:`exactness.door_torch`) trains a
cell and returns the raw ``exactness.models.Net`` and this rank's dataset
indices per step. The model is :class:`HFNet`: the matrix's ``Net`` (its
weights, so the matrix's reference applies) called as a Hugging Face model,
``model(x=..., labels=..., idx=...)``; it records the ``idx`` of each
training forward (the batch's dataset indices; Trainer keeps the column:
``forward`` names it). What it returns is the shape's (:data:`OUTPUTS`):

- Trainer (SGD at the matrix's rate, constant, no clipping, ``max_steps``
  the matrix's): ``model_output`` (a ``ModelOutput`` whose loss is computed
  inside from ``labels=``), ``loss_tuple`` (``(loss, logits)``),
  ``hidden_states`` (``config.output_hidden_states=True``: the hidden states
  too), ``compute_loss_penalty`` (a subclass's ``compute_loss`` adds the
  parameter penalty), ``compute_loss_func`` (a dict of features, the loss
  ``Trainer(compute_loss_func=)`` over ``num_items_in_batch``),
  ``model_output_accumulated`` (``gradient_accumulation_steps=2``),
  ``control_off_by_1pct`` (``compute_loss`` 1% too large on rank 0: must be inexact);
- the accelerate loop of docs/huggingface.md (:func:`accelerate_loop`):
  ``tensor``, ``model_output`` (2 micro-batches, ``ol.backward(loss,
  count=)``), ``dict_aux`` (a dict of features plus the module's auxiliary loss).

Run: ``python -m pytest -q tests/exactness/test_doors.py -k "hf_trainer or accelerate"``
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig, TrainingArguments
from transformers.utils import ModelOutput

import omnilearn
from exactness.door_torch import by_step, session_settings
from exactness.doors import DoorCell
from exactness.matrix import GLOBAL_BATCH, LR, STEPS
from exactness.models import PENALTY_WEIGHT, HFOutput, Data, Net
from omnilearn.integrations.hf import OmniLearnTrainer


@dataclass
class HiddenOutput(ModelOutput):
    """What a ``transformers`` model returns with ``output_hidden_states=True``."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    hidden_states: tuple | None = None


# shape -> what the model returns from (y, [h1, h], loss or None)
OUTPUTS = {
    "model_output": lambda y, hs, loss: HFOutput(loss, y, hs[-1]),
    "model_output_accumulated": lambda y, hs, loss: HFOutput(loss, y, hs[-1]),
    "compute_loss_penalty": lambda y, hs, loss: HFOutput(loss, y, hs[-1]),
    "control_off_by_1pct": lambda y, hs, loss: HFOutput(loss, y, hs[-1]),
    "loss_tuple": lambda y, hs, loss: (loss, y),
    "hidden_states": lambda y, hs, loss: HiddenOutput(loss, y, tuple(hs)),
    "compute_loss_func": lambda y, hs, loss: {"logits": y, "features": hs[-1]},
    "tensor": lambda y, hs, loss: y,
    "dict_aux": lambda y, hs, loss: {"y": y, "h": hs[-1]},
}


class HFNet(Net):
    """``Net`` with a Hugging Face calling convention and the shape's output (module docstring)."""

    def __init__(self, shape: str) -> None:
        super().__init__("hidden_states", "mean")  # Net's forward returns (y, [h1, h])
        self.output, self.seen = OUTPUTS[shape], []
        self.config = PretrainedConfig(output_hidden_states=shape == "hidden_states")

    def forward(self, x, labels=None, idx=None, output_hidden_states=None):
        if idx is not None and torch.is_grad_enabled():
            self.seen.append(idx.tolist())
        y, hs = super().forward(x)
        if not (self.config.output_hidden_states if output_hidden_states is None else output_hidden_states):
            hs = hs[-1:]
        return self.output(y, hs, None if labels is None else F.mse_loss(y, labels))


class Items(torch.utils.data.Dataset):
    """The matrix's regression data as Hugging Face items: ``{"x", "labels", "idx"}``."""

    def __init__(self) -> None:
        self.data = Data(tokens=False)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict:
        x, t, i = self.data[i]
        return {"x": x, "labels": t, "idx": i}


class PenaltyTrainer(OmniLearnTrainer):
    """A ``compute_loss`` override, as users write them: Trainer's loss plus a penalty on the parameters."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        return loss + PENALTY_WEIGHT * sum(p.square().sum() for p in model.parameters())


class OffTrainer(OmniLearnTrainer):
    """The control: rank 0's loss 1% too large."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        return loss * (1.01 if self.session.rank == 0 else 1.0)


def item_mean(outputs, labels, num_items_in_batch):
    """``Trainer(compute_loss_func=)``: the squared errors summed, over the items Trainer counted (labels != -100)."""
    return F.mse_loss(outputs["logits"], labels, reduction="sum") / num_items_in_batch


def trainer(cell: DoorCell, out: str) -> OmniLearnTrainer:
    k, net = cell.row.accumulation, HFNet(cell.shape)
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=k,
                             max_steps=STEPS, learning_rate=LR, lr_scheduler_type="constant", max_grad_norm=0.0,
                             save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=0)
    kind = {"compute_loss_penalty": PenaltyTrainer, "control_off_by_1pct": OffTrainer}.get(cell.shape, OmniLearnTrainer)
    return kind(model=net, args=args, train_dataset=Items(),
                optimizers=(torch.optim.SGD(net.parameters(), lr=LR), None),
                compute_loss_func=item_mean if cell.shape == "compute_loss_func" else None,
                omnilearn=dict(global_batch=GLOBAL_BATCH, **session_settings(cell)))


def accelerate_loop(cell: DoorCell) -> tuple[Net, list[list[int]]]:
    """docs/huggingface.md's custom loop: accelerate keeps the group and the optimizer, OmniLearn the rest."""
    from accelerate import Accelerator

    k = cell.row.accumulation
    accelerator = Accelerator(cpu=True)
    ol = omnilearn.setup(global_batch=GLOBAL_BATCH, accumulation_steps=k, **session_settings(cell))
    net = HFNet(cell.shape)
    model = ol.wrap_model(net)
    optimizer = accelerator.prepare(torch.optim.SGD(net.parameters(), lr=LR))
    seen = []
    for micro_batches in ol.data_loader(Data(tokens=False)):
        for x, t, idx in (micro_batches if k > 1 else [micro_batches]):
            seen.append(idx.tolist())
            with accelerator.autocast():
                if cell.shape == "model_output":
                    loss = model(x, labels=t).loss
                elif cell.shape == "dict_aux":
                    loss = F.mse_loss(model(x)["y"], t) + net.aux
                else:
                    loss = F.mse_loss(model(x), t)
            ol.backward(loss, count=len(t))
        optimizer.step()
        optimizer.zero_grad()
        ol.step()
        if ol.steps_done == STEPS:
            break
    ol.finish()
    return net, by_step(seen, k)


def train(cell: DoorCell) -> tuple[Net, list[list[int]]]:
    """The cell through its door: the trained ``Net`` and this rank's indices per step."""
    if cell.door == "accelerate":
        return accelerate_loop(cell)
    with tempfile.TemporaryDirectory() as out:
        t = trainer(cell, out)
        t.train()
    net = t.model
    return net, by_step(net.seen, cell.row.accumulation)

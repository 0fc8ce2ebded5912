"""The Lightning doors' shapes: ``Trainer(strategy=OmniLearnStrategy(...))`` and Fabric (``OmniLearnFabricStrategy``).

:func:`train` (called in a rank of :mod:`exactness.door_torch`) trains a
cell and returns the raw ``exactness.models.Net`` and this rank's dataset
indices per step (each batch is the matrix's ``(x, target, index)``), in
float64 (``precision="64-true"``), SGD at the matrix's rate, for the
matrix's steps. The shapes, each a few lines of :data:`STEPS_OF`
(``(module or model, x, t) -> what training_step returns``) or of :func:`fabric_loop`:

- Lightning: ``loss_tensor`` (``training_step`` returns the loss),
  ``loss_dict`` (``{"loss": ..., "logits": ...}``), ``forward_tuple_aux``
  (``forward`` returns ``(y, [h1, h])``; the auxiliary loss the module kept
  added), ``forward_dict_accumulated`` (``forward`` returns a dict,
  ``accumulate_grad_batches=2``), ``manual_optimization``
  (``automatic_optimization=False``: ``manual_backward``, ``opt.step()``),
  ``control_off_by_1pct`` (rank 0's loss 1% too large: must be inexact);
- Fabric (``fabric.backward(loss)``): ``loss_tuple`` (``model(x, labels=t)``
  returns ``(loss, y)``), ``dict_aux`` (a dict of features plus the
  auxiliary loss), ``tensor_accumulated`` (2 micro-batches, ``no_backward_sync``
  on the first).

Run: ``python -m pytest -q tests/exactness/test_doors.py -k "lightning or fabric"``
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
import lightning.pytorch as pl
from torch.utils.data import DataLoader

from exactness.door_torch import by_step, session_settings
from exactness.doors import DoorCell
from exactness.matrix import GLOBAL_BATCH, LR, STEPS
from exactness.models import Data, Net
from omnilearn.integrations.lightning import OmniLearnStrategy
from omnilearn.integrations.lightning_fabric import OmniLearnFabricStrategy

# shape -> what forward returns from (y, [h1, h]); the Lightning module's and Fabric's model alike
FORWARDS = {
    "forward_tuple_aux": lambda y, hs: (y, hs),
    "forward_dict_accumulated": lambda y, hs: {"y": y, "features": hs[-1]},
    "dict_aux": lambda y, hs: {"y": y, "h": hs[-1]},
}
# shape -> training_step's value from (the module, x, t)
STEPS_OF = {
    "loss_tensor": lambda m, x, t: F.mse_loss(m(x), t),
    "loss_dict": lambda m, x, t: (lambda y: {"loss": F.mse_loss(y, t), "logits": y.detach()})(m(x)),
    "forward_tuple_aux": lambda m, x, t: F.mse_loss(m(x)[0], t) + m.net.aux,
    "forward_dict_accumulated": lambda m, x, t: F.mse_loss(m(x)["y"], t),
    "manual_optimization": lambda m, x, t: F.mse_loss(m(x), t),
    "control_off_by_1pct": lambda m, x, t: F.mse_loss(m(x), t) * (1.01 if m.global_rank == 0 else 1.0),
}


class Model(Net):
    """``Net`` whose forward returns the shape's output: ``(loss, y)`` given ``labels``, else :data:`FORWARDS`'s."""

    def __init__(self, shape: str) -> None:
        super().__init__("hidden_states", "mean")  # Net's forward returns (y, [h1, h])
        self.pack = FORWARDS.get(shape, lambda y, hs: y)

    def forward(self, x, labels=None):
        y, hs = super().forward(x)
        return (F.mse_loss(y, labels), y) if labels is not None else self.pack(y, hs)


class Module(pl.LightningModule):
    def __init__(self, shape: str) -> None:
        super().__init__()
        self.net, self.shape, self.seen = Model(shape), shape, []
        self.automatic_optimization = shape != "manual_optimization"

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, t, idx = batch
        self.seen.append(idx.tolist())
        out = STEPS_OF[self.shape](self, x, t)
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(out)
            opt.step()
        return out

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


def loader() -> DataLoader:
    return DataLoader(Data(tokens=False), batch_size=8, shuffle=True)


def lightning_fit(cell: DoorCell) -> tuple[Net, list[list[int]]]:
    k, module = cell.row.accumulation, Module(cell.shape)
    strategy = OmniLearnStrategy(global_batch=GLOBAL_BATCH, **session_settings(cell))
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=cell.world, max_steps=STEPS,
                         precision="64-true", accumulate_grad_batches=k, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0)
    trainer.fit(module, loader())
    return module.net, by_step(module.seen, k)


def fabric_loop(cell: DoorCell) -> tuple[Net, list[list[int]]]:
    """tests/dist/test_lightning_fabric.py's loop, with the shape's forward and loss."""
    k = cell.row.accumulation
    strategy = OmniLearnFabricStrategy(global_batch=GLOBAL_BATCH, accumulation_steps=k, total_steps=STEPS,
                                       **session_settings(cell))
    net, default = Model(cell.shape), torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # Fabric's "64-true" hands outputs back in the default dtype
    try:
        fabric = Fabric(strategy=strategy, accelerator="cpu", devices=cell.world, precision="64-true")
        fabric.launch()
        model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=LR))
        train, seen, session = fabric.setup_dataloaders(loader()), [], strategy.session
        while session.steps_done < STEPS:
            for i, (x, t, idx) in enumerate(train):
                seen.append(idx.tolist())
                accumulating = (i + 1) % k != 0
                with fabric.no_backward_sync(model, enabled=accumulating):
                    if cell.shape == "loss_tuple":
                        loss = model(x, labels=t)[0]
                    elif cell.shape == "dict_aux":
                        loss = F.mse_loss(model(x)["y"], t) + net.aux
                    else:
                        loss = F.mse_loss(model(x), t)
                    fabric.backward(loss)
                if not accumulating:
                    opt.step()
                    opt.zero_grad()
                    if session.steps_done == STEPS:
                        break
        session.finish()
    finally:
        torch.set_default_dtype(default)
    return net, by_step(seen, k)


def train(cell: DoorCell) -> tuple[Net, list[list[int]]]:
    """The cell through its door: the trained ``Net`` and this rank's indices per step."""
    return fabric_loop(cell) if cell.door == "fabric" else lightning_fit(cell)

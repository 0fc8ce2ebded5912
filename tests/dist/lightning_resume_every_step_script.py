"""The Lightning side of tests/dist/test_lightning_resume_every_step.py: the fit, the plain reference, the 2 ranks.

A float64 MLP (test_lightning_exact's shape) trained by ``pl.Trainer(strategy=OmniLearnStrategy(...))`` for 3
epochs of 5 optimizer steps (120 samples, global batch 24, OmniLearn's seeded shuffle per epoch), an LR scheduler
stepped every optimizer step (``configure_optimizers`` with ``"interval": "step"``). Two variants: Adam with
``accumulate_grad_batches=2`` (one and two workers) and SGD with momentum without accumulation (one worker).
Imported by the test where it runs (Lightning's import is dear; every pytest-xdist worker collects the test), and
by the test's 2 rank processes (:func:`two_workers`, started from the preloaded fork server: tests/ranks.py).

Run: ``python -m pytest -q tests/dist/test_lightning_resume_every_step.py``
"""

from __future__ import annotations

import os
from pathlib import Path
import warnings

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from omnilearn.data.schedule import GlobalPlan
from omnilearn.integrations.lightning import OmniLearnStrategy

SAMPLES, GLOBAL_BATCH, STEPS_PER_EPOCH, STEPS = 120, 24, 5, 15
VARIANTS = {"adam-k2": ("adam", 2), "sgd-k1": ("sgd", 1)}  # name: (optimizer, accumulate_grad_batches)
SPEEDS_3_1 = "0.0001,0.0003"  # scripted per-sample times of speeds 3,1: the 2-rank split moves at step 3


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 6, generator=g, dtype=torch.float64)
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long())


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).double()


def optimizer_and_schedule(params, optimizer: str):
    opt = (torch.optim.Adam(params, lr=0.02) if optimizer == "adam"
           else torch.optim.SGD(params, lr=0.1, momentum=0.9))
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.8)


class Net(pl.LightningModule):
    def __init__(self, optimizer: str) -> None:
        super().__init__()
        self.net, self.optimizer = mlp(), optimizer

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        opt, schedule = optimizer_and_schedule(self.parameters(), self.optimizer)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def every_step(directory: Path) -> pl.callbacks.ModelCheckpoint:
    """A checkpoint at the end of every optimizer step: ``directory/step=<k>.ckpt``."""
    return pl.callbacks.ModelCheckpoint(dirpath=directory, every_n_train_steps=1, save_top_k=-1, filename="{step}")


def fit(variant: str, world: int = 1, ckpt: str | Path | None = None, save_to: Path | None = None) -> dict:
    """A fresh model and Trainer trained to step ``STEPS`` (from ``ckpt``; saving every step to ``save_to``)."""
    optimizer, k = VARIANTS[variant]
    if world == 1:
        os.environ.pop("MASTER_PORT", None)  # Lightning keeps the port of a one-process group there: a new one
    strategy = OmniLearnStrategy(global_batch=GLOBAL_BATCH, speeds="3,1" if world == 2 else None,
                                 control_interval=3, min_batch=4)
    callbacks = [every_step(save_to)] if save_to is not None else []
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=world, max_steps=STEPS, precision="64-true",
                         accumulate_grad_batches=k, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=bool(callbacks), callbacks=callbacks,
                         num_sanity_val_steps=0)
    model = Net(optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, DataLoader(data(), batch_size=GLOBAL_BATCH // world // k, shuffle=True),
                    ckpt_path=None if ckpt is None else str(ckpt))
    session = trainer.strategy.session
    return {"weights": {name: v.detach().clone() for name, v in model.net.state_dict().items()},
            "steps": (trainer.global_step, session.steps_done, trainer.current_epoch),
            "plans": [tuple(session.schedule.peek(s)) for s in range(STEPS)]}


def reference(variant: str) -> dict[str, torch.Tensor]:
    """One process, no Lightning, no OmniLearn: the optimizer and schedule on the plan's global batches."""
    model, (x, y) = mlp(), data().tensors
    plan = GlobalPlan(SAMPLES, GLOBAL_BATCH, seed=0)
    opt, schedule = optimizer_and_schedule(model.parameters(), VARIANTS[variant][0])
    for step in range(STEPS):
        idx = torch.as_tensor(plan.step_indices(step))
        opt.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
        schedule.step()
    return {name: v.detach() for name, v in model.state_dict().items()}


def two_workers(rank: int, store: str, out: str, one_dir: str) -> None:
    """Rank ``rank`` of 2 (gloo, joined as torchrun would leave it): the uninterrupted Adam run saving every step
    to ``out/two``, then a resume from each of its checkpoints and from each of ``one_dir``'s (one worker's)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", GROUP_RANK="0",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29400")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    saved = Path(out) / "two"
    result = {"whole": fit("adam-k2", 2, save_to=saved)}
    dist.barrier()  # rank 0 wrote every checkpoint
    for k in range(1, STEPS):
        result[("two", k)] = fit("adam-k2", 2, ckpt=saved / f"step={k}.ckpt")
        result[("one", k)] = fit("adam-k2", 2, ckpt=Path(one_dir) / f"step={k}.ckpt")
    torch.save(result, Path(out) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()

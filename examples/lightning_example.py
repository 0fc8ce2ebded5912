"""A PyTorch Lightning module trained with OmniLearn's strategy: validation, accumulation, checkpoint and resume.

    torchrun --standalone --nproc-per-node 2 examples/lightning_example.py --speeds 3,1 --out runs/pl \\
        --accumulate 2 --ckpt-dir runs/pl-ckpt --ckpt-every 20 --max-steps 40
    torchrun --standalone --nproc-per-node 2 examples/lightning_example.py --speeds 3,1 --out runs/pl \\
        --accumulate 2 --max-steps 60 --resume runs/pl-ckpt/step=20.ckpt      # continues data and controller
    python examples/lightning_example.py                # one process

A plain Lightning script: a ``LightningModule`` with a training and a
validation step, two ``DataLoader``\\ s, a ``Trainer`` with
``accumulate_grad_batches`` and a ``ModelCheckpoint``, ``fit(ckpt_path=...)``
to resume. OmniLearn lines: 2 (marked ``# OmniLearn``): the import and the
strategy. Each worker's batch reaches Lightning's logger (a CSVLogger in
``--csv-dir``) as ``omnilearn/batch_rank<i>``; ``val_loss`` and ``val_acc``
(logged with ``sync_dist=True``) are over the whole validation set, each
rank evaluating its own part.

Run its test: ``python -m pytest -q tests/examples/test_lightning_example.py``
"""

from __future__ import annotations

import argparse
import os

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from omnilearn.integrations.lightning import OmniLearnStrategy  # OmniLearn


def blobs(samples: int, dim: int = 16, classes: int = 4, seed: int = 0) -> TensorDataset:
    """Gaussian clusters, one per class: an MLP separates them within a few dozen steps."""
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(classes, dim, generator=g) * 1.5
    g.manual_seed(seed)
    y = torch.randint(classes, (samples,), generator=g)
    return TensorDataset(centres[y] + torch.randn(samples, dim, generator=g), y)


class Classifier(pl.LightningModule):
    def __init__(self, dim: int = 16, classes: int = 4, hidden: int = 512, lr: float = 0.05) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, classes))
        self.lr = lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--speeds", help="emulated relative worker speeds, e.g. 3,1")
    p.add_argument("--max-steps", type=int, default=60)
    p.add_argument("--global-batch", type=int, default=128)
    p.add_argument("--accumulate", type=int, default=1, help="Trainer(accumulate_grad_batches=K)")
    p.add_argument("--val-every", type=int, default=20, help="validate every N training batches")
    p.add_argument("--ckpt-dir", help="ModelCheckpoint directory (a checkpoint every --ckpt-every steps)")
    p.add_argument("--ckpt-every", type=int, default=20)
    p.add_argument("--resume", help="a checkpoint to resume from: fit(ckpt_path=...)")
    p.add_argument("--out", help="OmniLearn run directory")
    p.add_argument("--csv-dir", default="runs/lightning_logs", help="Lightning's CSVLogger directory")
    args = p.parse_args()

    torch.manual_seed(0)
    model = Classifier()
    train = DataLoader(blobs(4096), batch_size=64, shuffle=True)  # the batch size is OmniLearn's to set
    val = DataLoader(blobs(1000, seed=1), batch_size=100)
    strategy = OmniLearnStrategy(global_batch=args.global_batch, speeds=args.speeds, control_interval=10,  # OmniLearn
                                 out=args.out, overwrite=True)
    checkpoints = [ModelCheckpoint(args.ckpt_dir, "{step}", every_n_train_steps=args.ckpt_every, save_top_k=-1)]
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu",
                         devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)), max_steps=args.max_steps,
                         accumulate_grad_batches=args.accumulate, val_check_interval=args.val_every * args.accumulate,
                         check_val_every_n_epoch=None, num_sanity_val_steps=0,
                         logger=CSVLogger(args.csv_dir, name="example"), enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=args.ckpt_dir is not None,
                         callbacks=checkpoints if args.ckpt_dir else [], log_every_n_steps=5)
    trainer.fit(model, train, val, ckpt_path=args.resume)
    metrics = {k: round(float(v), 4) for k, v in trainer.callback_metrics.items() if k.startswith("val")}
    if trainer.is_global_zero:
        print(f"global_step {trainer.global_step}, {metrics}")
    if strategy.summary is not None:
        batches = [round(w["mean_batch"]) for w in strategy.summary["workers"]]
        print(f"final batches {batches}, balance efficiency {strategy.summary['balance_efficiency']:.2f}")


if __name__ == "__main__":
    main()

"""A PyTorch Lightning module trained with OmniLearn's strategy.

    torchrun --standalone --nproc-per-node 2 examples/lightning_example.py --speeds 3,1 --out runs/pl
    python examples/lightning_example.py                # one process

A plain Lightning script: a ``LightningModule``, a ``DataLoader``, a
``Trainer``. OmniLearn lines: 3 (marked ``# OmniLearn``): the import, the
strategy, and ``use_distributed_sampler=False`` (OmniLearn's sampler
replaces Lightning's). The per-worker batches reach Lightning's logger
(here a CSVLogger in ``--csv-dir``) as ``omnilearn/batch_rank<i>``.
"""

from __future__ import annotations

import argparse
import os

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from omnilearn.integrations.lightning import OmniLearnStrategy  # OmniLearn


def blobs(samples: int, dim: int = 16, classes: int = 4, seed: int = 0) -> TensorDataset:
    """Gaussian clusters, one per class: an MLP separates them within a few dozen steps."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, dim, generator=g) * 1.5
    y = torch.randint(classes, (samples,), generator=g)
    return TensorDataset(centres[y] + torch.randn(samples, dim, generator=g), y)


class Classifier(pl.LightningModule):
    def __init__(self, dim: int = 16, classes: int = 4, hidden: int = 1024, lr: float = 0.05) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, classes))
        self.lr = lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--speeds", help="emulated relative worker speeds, e.g. 3,1")
    p.add_argument("--max-steps", type=int, default=80)
    p.add_argument("--global-batch", type=int, default=128)
    p.add_argument("--out", help="OmniLearn run directory")
    p.add_argument("--csv-dir", default="runs/lightning_logs", help="Lightning's CSVLogger directory")
    args = p.parse_args()

    torch.manual_seed(0)
    model = Classifier()
    loader = DataLoader(blobs(8192), batch_size=64, shuffle=True)  # the batch size is OmniLearn's to set
    strategy = OmniLearnStrategy(global_batch=args.global_batch, speeds=args.speeds, control_interval=10,  # OmniLearn
                                 out=args.out, overwrite=True)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu",
                         devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)), max_steps=args.max_steps,
                         logger=CSVLogger(args.csv_dir, name="example"), enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, log_every_n_steps=5,
                         use_distributed_sampler=False)  # OmniLearn
    trainer.fit(model, loader)
    if strategy.summary is not None:
        batches = [round(w["mean_batch"]) for w in strategy.summary["workers"]]
        print(f"final batches {batches}, balance efficiency {strategy.summary['balance_efficiency']:.2f}")


if __name__ == "__main__":
    main()

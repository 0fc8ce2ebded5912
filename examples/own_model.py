"""Your own model and dataset with OmniLearn: a small transformer classifier.

    torchrun --standalone --nproc-per-node 2 examples/own_model.py --speeds 3,1
    torchrun --standalone --nproc-per-node 2 examples/own_model.py --accumulation-steps 4
    python examples/own_model.py                # one process, no process group
    torchrun --nnodes 1:4 --rdzv-backend c10d --rdzv-endpoint HOST:29500 --max-restarts 3 \
        --nproc-per-node 2 examples/own_model.py --checkpoint-dir /shared/ckpt   # nodes may come and go

A plain DDP script differs in the lines marked ``# OmniLearn``: set-up,
the device, model wrapping, the data loader, the backward call, one call
per step, an optional evaluation record, the summary and the close.
OmniLearn lines: 19.
Model, dataset, loss, optimizer and LR schedule are ordinary PyTorch.
``--speeds 3,1`` emulates a worker three times slower than the other, so the
controller has something to balance: watch the "rebalance" lines.

Gradient accumulation (``--accumulation-steps K``): the global batch stays
the batch of one optimizer step; each worker trains its share as K
micro-batches (the loader hands out the K of a step together), and
``ol.backward(loss)`` weights each exactly and lets DDP synchronise only on
the last. Use it instead of ``model.no_sync()``, which OmniLearn refuses.

Restarts (``--checkpoint-dir DIR``, on storage every node sees): the script
resumes from the newest checkpoint in DIR, saves one every
``--checkpoint-every`` steps, and when a worker or a whole node dies the
survivors save the step in flight's start there before torchrun's agent
restarts them (docs/failures.md, "A crash costs one step"): the job goes on
at the new worker count, one step lost. A stop signal (a scheduler's time
limit or preemption, ``scancel``, ``kubectl delete``) stops every rank after
the same step: a final checkpoint there, exit 143, and a requeued job
resumes from it. Recipes: examples/slurm/, examples/kubernetes/.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import omnilearn  # OmniLearn
from omnilearn.stopping import exit_code  # OmniLearn: 143 after SIGTERM, 130 after SIGINT


class MajorityToken(Dataset):
    """Random token sequences; the label is whichever of tokens 0..classes-1 occurs most often."""

    def __init__(self, samples: int, length: int = 32, vocab: int = 16, classes: int = 4, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randint(vocab, (samples, length), generator=g)
        counts = torch.stack([(self.x == c).sum(1) for c in range(classes)], dim=1)
        self.y = (counts + torch.rand(counts.shape, generator=g) * 0.5).argmax(1)  # ties broken at random

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class TransformerClassifier(nn.Module):
    def __init__(self, vocab: int = 16, classes: int = 4, length: int = 32, dim: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(1, length, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=4 * dim, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x) + self.pos).mean(dim=1))


@torch.no_grad()
def evaluate(model: nn.Module, data: MajorityToken, device: torch.device) -> tuple[float, float]:
    model.eval()
    logits, y = model(data.x.to(device)), data.y.to(device)
    model.train()
    return F.cross_entropy(logits, y).item(), (logits.argmax(1) == y).float().mean().item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--speeds", default=None, help="emulated relative worker speeds, e.g. 3,1 (default: all equal)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--global-batch", type=int, default=128)
    p.add_argument("--accumulation-steps", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--out", default=None, help="write a run directory here (metrics, summary, plots input)")
    p.add_argument("--checkpoint-dir", default=None, help="resume from / save checkpoints here (shared storage)")
    p.add_argument("--checkpoint-every", type=int, default=200, help="steps between checkpoints (default 200)")
    args = p.parse_args()

    ol = omnilearn.setup(global_batch=args.global_batch, speeds=args.speeds, control_interval=10,  # OmniLearn
                         accumulation_steps=args.accumulation_steps, out=args.out, overwrite=True)
    device = ol.device  # OmniLearn: was torch.device(f"cuda:{local_rank}")
    train, test = MajorityToken(4096, seed=1), MajorityToken(1024, seed=2)
    torch.manual_seed(0)  # the same initial weights (DDP would also copy rank 0's)
    model = ol.wrap_model(TransformerClassifier())  # OmniLearn: instead of DDP(model); then seeds RNGs per rank
    loader = ol.data_loader(train)  # OmniLearn: instead of DataLoader(train, sampler=DistributedSampler(...))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(loader))
    saved = dict(model=model, optimizer=optimizer, scheduler=schedule)
    if args.checkpoint_dir:
        ol.load_checkpoint(args.checkpoint_dir, **saved)  # OmniLearn: the newest checkpoint, at any worker count

    for epoch in range(ol.epoch, args.epochs):  # OmniLearn: a resumed run starts at its checkpoint's epoch
        loader.set_epoch(epoch)
        for batch in loader:
            micro_batches = batch if args.accumulation_steps > 1 else [batch]  # K micro-batches, or the batch
            optimizer.zero_grad()
            for x, y in micro_batches:
                x, y = x.to(device), y.to(device)
                ol.backward(F.cross_entropy(model(x), y))  # OmniLearn: instead of loss.backward()
            optimizer.step()
            schedule.step()
            ol.step()  # OmniLearn: times the step; every 10 steps the controller may move batches
            if args.checkpoint_dir and ol.next_step % args.checkpoint_every == 0:  # OmniLearn: periodic save
                ol.save_checkpoint(args.checkpoint_dir, **saved)  # OmniLearn
            if ol.should_stop:  # OmniLearn: SIGTERM (a time limit, a preemption) reached a rank; all stop here
                if args.checkpoint_dir:
                    ol.save_checkpoint(args.checkpoint_dir, **saved)  # OmniLearn
                ol.close()  # OmniLearn
                raise SystemExit(exit_code())  # OmniLearn
        test_loss, acc = evaluate(model, test, device)
        ol.log_eval(test_loss, acc, epoch)  # OmniLearn: optional, the accuracy goes into the run directory

    summary = ol.finish()  # OmniLearn: summary on rank 0, run directory if --out
    if summary is not None:
        batches = [round(w["mean_batch"]) for w in summary["workers"]]
        print(f"final batches {batches}, test accuracy {summary['test_accuracy']:.1%}, {summary['rebalances']} rebalances, "
              f"balance efficiency {summary['balance_efficiency']:.2f}")
    ol.close()  # OmniLearn: leaves the process group


if __name__ == "__main__":
    main()

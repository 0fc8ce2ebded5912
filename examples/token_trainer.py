"""A nanoGPT-style trainer with OmniLearn: random windows from one token array, no Dataset.

    torchrun --standalone --nproc-per-node 2 examples/token_trainer.py --speeds 3,1 --out runs/tok
    torchrun --standalone --nproc-per-node 2 examples/token_trainer.py --out runs/tok --resume --max-steps 200
    python examples/token_trainer.py                 # one process

The loop is nanoGPT's: ``get_batch`` samples random windows of the token
array (``np.memmap`` of uint16 from ``--data FILE``, or a structured corpus
generated here), gradient accumulation over ``--accumulation-steps``
micro-batches, ``torch.autocast`` (``--amp``: bfloat16), gradient clipping,
a checkpoint every ``--checkpoint-every`` steps and ``--resume``.
OmniLearn lines: 14 (marked ``# OmniLearn``): ``random_indices`` replaces
``torch.randint`` (the step's draw of B windows, this worker's slice),
``ol.backward`` replaces ``loss.backward`` (each micro-batch weighted
exactly), ``batch_multiple=8`` keeps batch shapes few for ``--compile``,
and the session's checkpoint carries the data position and the controller.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import omnilearn  # OmniLearn


class GPT(nn.Module):
    def __init__(self, vocab: int, block: int, dim: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Parameter(torch.zeros(1, block, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(block), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        return self.head(self.blocks(self.tok(idx) + self.pos[:, :t], mask=self.mask[:t, :t], is_causal=True))


def corpus(path: str | None, tokens: int = 200_000, vocab: int = 64) -> np.ndarray:
    """``--data``'s uint16 tokens, or a Markov chain with a clear next-token rule (90% of the time)."""
    if path:
        return np.memmap(path, dtype=np.uint16, mode="r")
    rng = np.random.default_rng(0)
    data, noise = np.empty(tokens, dtype=np.uint16), rng.integers(0, vocab, tokens)
    data[0] = 0
    for i, follow in enumerate(rng.random(tokens - 1) < 0.9, start=1):
        data[i] = (data[i - 1] * 5 + 3) % vocab if follow else noise[i]
    return data


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", help="uint16 token file (nanoGPT's train.bin); default: a generated corpus")
    p.add_argument("--block", type=int, default=32)
    p.add_argument("--global-batch", type=int, default=64, help="sequences per optimizer step, all workers")
    p.add_argument("--accumulation-steps", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=120)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--speeds", help="emulated relative worker speeds, e.g. 3,1")
    p.add_argument("--amp", action="store_true", help="autocast to bfloat16")
    p.add_argument("--compile", action="store_true", help="torch.compile(dynamic=True)")
    p.add_argument("--out", help="run directory (metrics, summary; checkpoints in OUT/checkpoints)")
    p.add_argument("--checkpoint-every", type=int, default=20)
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in OUT/checkpoints")
    args = p.parse_args()

    ol = omnilearn.setup(global_batch=args.global_batch, accumulation_steps=args.accumulation_steps,  # OmniLearn
                         batch_multiple=8, speeds=args.speeds, control_interval=10, total_steps=args.max_steps,
                         out=args.out, overwrite=True)
    device = ol.device  # OmniLearn: was torch.device(f"cuda:{local_rank}")
    data = corpus(args.data)
    vocab = int(data.max()) + 1

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        ix = ol.random_indices(len(data) - args.block)  # OmniLearn: was torch.randint(len(data) - block, (b,))
        x = torch.stack([torch.from_numpy(data[i:i + args.block].astype(np.int64)) for i in ix.tolist()])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + args.block].astype(np.int64)) for i in ix.tolist()])
        return x.to(device), y.to(device)

    torch.manual_seed(0)
    model = ol.wrap_model(GPT(vocab, args.block))  # OmniLearn: was DDP(model)
    raw = ol.module  # OmniLearn: was model.module (one process: the model itself)
    optimizer = torch.optim.AdamW(raw.parameters(), lr=args.lr, weight_decay=0.1)
    checkpoints = Path(args.out or "runs/token_trainer") / "checkpoints"
    if args.resume:
        ol.load_checkpoint(checkpoints, model=raw, optimizer=optimizer)  # OmniLearn: was torch.load(...)
    step_model = torch.compile(model, dynamic=True) if args.compile else model
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp)

    x, y = get_batch() if ol.next_step < args.max_steps else (None, None)  # OmniLearn: was iter_num
    for step in range(ol.next_step, args.max_steps):  # OmniLearn: was range(iter_num, ...) from the checkpoint
        lr = args.lr * min(1.0, (step + 1) / 10) * 0.5 * (1 + math.cos(math.pi * step / args.max_steps))
        for group in optimizer.param_groups:
            group["lr"] = lr
        for _ in range(args.accumulation_steps):
            with autocast:
                logits = step_model(x)
                loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            if step + 1 < args.max_steps or _ + 1 < args.accumulation_steps:
                x, y = get_batch()  # fetch the next micro-batch ahead, as nanoGPT does
            ol.backward(loss)  # OmniLearn: was loss.backward() (weighted by this micro-batch's share)
        torch.nn.utils.clip_grad_norm_(raw.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ol.step(lr=lr)  # OmniLearn: times the step; every 10 steps the controller may move batches
        if (step + 1) % args.checkpoint_every == 0:
            ol.save_checkpoint(checkpoints, model=raw, optimizer=optimizer)  # OmniLearn: was torch.save(...)

    summary = ol.finish()  # OmniLearn: summary on rank 0
    if summary is not None:
        batches = [round(w["mean_batch"]) for w in summary["workers"]]
        print(f"final batches {batches}, loss {summary['final_train_loss']:.3f}, "
              f"balance efficiency {summary['balance_efficiency']:.2f}")
    ol.close()  # OmniLearn: leaves the process group


if __name__ == "__main__":
    main()

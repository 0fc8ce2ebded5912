"""A small transformer language model sharded with FSDP2 (``fully_shard``) and balanced by OmniLearn.

    torchrun --standalone --nproc-per-node 2 examples/fsdp_transformer.py --speeds 3,1 --out runs/fsdp
    torchrun --standalone --nproc-per-node 2 examples/fsdp_transformer.py --out runs/fsdp \\
        --checkpoint-dir runs/fsdp-ckpt --stop-at 20      # then again with --resume (at any worker count)

The script starts from the torchtitan shape: build the model, ``fully_shard``
each block and then the root, an optimizer over the sharded parameters, and
``torch.distributed.checkpoint`` (DCP) for checkpoints. OmniLearn lines: 10
(marked ``# OmniLearn``): ``ol.wrap_model`` takes the sharded model as it is
(no DDP around it; its reduce-scatters are weighted by each worker's batch
share and summed), the loader hands each worker its share of every global
batch, and ``ol.save_checkpoint``/``ol.load_checkpoint`` write the shards
through DCP with the session's state beside them, so a resumed run
continues the data where it stopped, at the same or another worker count.
Every sequence has the same number of tokens, so the mean loss is exact as
it is (with padding: ``ol.backward(loss, count=n_tokens)``). Nothing is
downloaded: the data is generated locally (sequences.py). docs/fsdp.md explains the rest.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard

import omnilearn  # OmniLearn
from sequences import Sequences  # the examples' token data (same folder)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.size(1)
        mask = torch.triu(torch.ones(n, n, dtype=torch.bool, device=x.device), diagonal=1)
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 64, layers: int = 2, heads: int = 4, length: int = 32) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, dim), nn.Parameter(torch.zeros(length, dim))
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.size(1)]
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--speeds", help="emulated relative worker speeds, e.g. 3,1 (default: all equal)")
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--out", help="write an OmniLearn run directory here")
    p.add_argument("--checkpoint-dir", help="save a sharded checkpoint here every --checkpoint-every steps")
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--stop-at", type=int, help="stop after this step (to try --resume)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --checkpoint-dir")
    args = p.parse_args()

    ol = omnilearn.setup(global_batch=args.global_batch, speeds=args.speeds, control_interval=10,  # OmniLearn
                         total_steps=args.steps, out=args.out, overwrite=not args.resume)  # OmniLearn
    torch.manual_seed(0)
    model = TinyLM()
    for block in model.layers:  # FSDP2, the usual way: each block, then the root
        fully_shard(block)
    fully_shard(model)
    model = ol.wrap_model(model)  # OmniLearn: recognised as sharded; not wrapped in DDP
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    loader = ol.data_loader(Sequences(4096))  # OmniLearn: was DataLoader(..., sampler=DistributedSampler(...))
    if args.resume:
        ol.load_checkpoint(args.checkpoint_dir, model=model, optimizer=optimizer)  # OmniLearn: shards via DCP
    step = ol.next_step  # OmniLearn: 0, or where the resumed run stopped
    while step < args.steps:
        for tokens in loader:  # one epoch
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())  # the mean over this batch
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            ol.step(loss)  # OmniLearn: ends the step; every control interval, new batch sizes
            step += 1
            if args.checkpoint_dir and step % args.checkpoint_every == 0:
                ol.save_checkpoint(args.checkpoint_dir, model=model, optimizer=optimizer)  # OmniLearn
            if step in (args.steps, args.stop_at):
                break
        if step == args.stop_at:
            break
    summary = ol.finish()  # OmniLearn: the per-worker table on rank 0
    if summary is not None:
        print(f"stopped after step {step}, loss {summary['final_train_loss']:.4f}")


if __name__ == "__main__":
    main()

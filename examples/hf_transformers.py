"""A Hugging Face ``transformers`` causal LM trained with OmniLearn in the common DDP shape.

    torchrun --standalone --nproc-per-node 2 examples/hf_transformers.py --speeds 3,1 --out runs/hf
    python examples/hf_transformers.py                 # one process

The model is built from a local ``GPT2Config`` (nothing is downloaded); the
data is a map-style ``Dataset`` of fixed-length token sequences generated locally
(sequences.py). The plain DDP script this starts from uses ``init_process_group``,
``DistributedDataParallel`` and ``DataLoader(..., sampler=DistributedSampler)``.
OmniLearn lines: 8 (marked ``# OmniLearn``). Every sequence has the same
number of tokens, so the model's mean loss is exact as it is; with padding,
pass the token count: ``ol.backward(loss, count=n_tokens)``.
"""

from __future__ import annotations

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup

import omnilearn  # OmniLearn
from sequences import Sequences  # the examples' token data (same folder)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--speeds", help="emulated relative worker speeds, e.g. 3,1 (default: all equal)")
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--out", help="write an OmniLearn run directory here")
    args = p.parse_args()

    ol = omnilearn.setup(global_batch=args.global_batch, speeds=args.speeds, control_interval=10,  # OmniLearn
                         out=args.out, overwrite=True)
    device = ol.device  # OmniLearn: was torch.device(f"cuda:{local_rank}")
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    model = ol.wrap_model(GPT2LMHeadModel(config))  # OmniLearn: was DDP(model.to(device), device_ids=[...])
    loader = ol.data_loader(Sequences(2048))  # OmniLearn: was DataLoader(data, batch_size=b, sampler=DistributedSampler)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    schedule = get_linear_schedule_with_warmup(optimizer, 10, args.epochs * len(loader))

    for epoch in range(args.epochs):
        loader.set_epoch(epoch)
        for ids in loader:
            ids = ids.to(device)
            loss = model(input_ids=ids, labels=ids).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
            ol.step(loss, lr=schedule.get_last_lr()[0])  # OmniLearn: times the step, feeds the controller

    summary = ol.finish()  # OmniLearn: summary on rank 0, run directory if --out
    if summary is not None:
        batches = [round(w["mean_batch"]) for w in summary["workers"]]
        print(f"final batches {batches}, balance efficiency {summary['balance_efficiency']:.2f}")
    ol.close()  # OmniLearn: was destroy_process_group()


if __name__ == "__main__":
    main()

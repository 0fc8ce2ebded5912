"""FSDP2 with ``memory=[...]`` under torchrun, as a user writes it, a worker lost: for tests/dist/test_memory_plan.py.

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 tests/dist/memory_plan_script.py OUT

The ranks' memory is declared 1:4, rank 0's sized (from a first session's counted bytes) for 10 samples. The
float64 MLP of tests/dist/test_fsdp.py, sharded per layer and at the root, trains 12 steps of 60 samples with SGD
and momentum, a DCP checkpoint every 4 steps and ``ol.load_checkpoint`` at the start. In the first attempt rank 1
SIGKILLs itself after step 6: rank 0 says the restart resumes from the last checkpoint (FSDP2's shards cannot be
saved by the survivors), and torchrun's restart resumes at step 4, each rank counting its memory plan again. The
last attempt's rank 0 writes ``OUT/attempt-<k>.pt``: where it started, its caps, the full weights.

Run: ``python -m pytest -q tests/dist/test_memory_plan.py``
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch

import omnilearn
from omnilearn.balance import memplan
from test_fsdp import full_weights, mlp, pair_loss, shard
from test_memory_plan import CAP0, _needs
from tokendata import PairData

STEPS, EVERY, KILL_AFTER = 12, 4, 6


def main(out: Path) -> None:
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    needs = _needs(int(os.environ["WORLD_SIZE"]))  # its omnilearn.setup joins torchrun's group
    small = int((needs.base + (CAP0 + 0.5) * needs.per_sample) / (1 - memplan.MARGIN))
    ol = omnilearn.setup(global_batch=60, memory=[small, 4 * small], control_interval=3, min_batch=3, device="cpu")
    model = ol.wrap_model(shard(mlp()))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = ol.data_loader(PairData())
    ol.load_checkpoint(out / "ckpt", model=model, optimizer=opt)
    start = ol.next_step
    while ol.next_step < STEPS:
        for x, y in loader:
            opt.zero_grad()
            ol.backward(pair_loss(model, x, y))
            opt.step()
            ol.step()
            if ol.next_step % EVERY == 0:
                ol.save_checkpoint(out / "ckpt", model=model, optimizer=opt)
            if attempt == 0 and ol.rank == 1 and ol.next_step == KILL_AFTER:
                os.kill(os.getpid(), signal.SIGKILL)
            if ol.next_step == STEPS:
                break
    weights = full_weights(model)
    if ol.rank == 0:
        torch.save({"start": start, "cap": ol.max_batch, "caps": [int(c) for c in ol.loop.caps.reported],
                    "weights": weights}, out / f"attempt-{attempt}.pt")
    ol.finish()


if __name__ == "__main__":
    main(Path(sys.argv[1]))

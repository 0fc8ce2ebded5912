"""A user's own training script for tests/faults/test_api_stops.py: the public API and the stop path of the docs.

    torchrun --standalone --nproc-per-node 2 tests/faults/api_stop_script.py OUT

Trains a tiny linear model on random data, epoch after epoch, until told to
stop. After every step each rank writes its step count to ``OUT/rank<R>.step``
(so a test knows how far it got); when ``ol.should_stop`` turns true it
saves a final checkpoint in ``OUT/ckpt``, writes ``OUT/rank<R>.stopped``
(``{"step": ..., "exit": ...}``), leaves the group and exits with
``omnilearn.stopping.exit_code()``. Never stopped: exits 3 after ``MAX_STEPS``.

Run: ``python -m pytest -q tests/faults/test_api_stops.py``
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import omnilearn
from omnilearn import stopping

MAX_STEPS = 20000  # a stop that never comes ends the script anyway


def write(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # a reader never sees half a number


def main(out: Path) -> None:
    ol = omnilearn.setup(global_batch=8, control_interval=3, device="cpu")
    torch.manual_seed(0)
    model = ol.wrap_model(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = ol.data_loader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)))
    for epoch in range(ol.epoch, MAX_STEPS):
        loader.set_epoch(epoch)
        for x, y in loader:
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            ol.step(loss)
            write(out / f"rank{ol.rank}.step", str(ol.next_step))
            if ol.should_stop:  # the preemption path of docs/failures.md
                ol.save_checkpoint(out / "ckpt", model=ol.module, optimizer=opt)
                write(out / f"rank{ol.rank}.stopped", json.dumps({"step": ol.next_step, "exit": stopping.exit_code()}))
                ol.close()
                raise SystemExit(stopping.exit_code())
            if ol.next_step >= MAX_STEPS:
                raise SystemExit(3)


if __name__ == "__main__":
    main(Path(sys.argv[1]))

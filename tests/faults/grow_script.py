"""A user's own script for tests/faults/test_grow_torchrun.py: a float64 job that a node joins mid-run.

    torchrun --nnodes 1:3 --rdzv-backend c10d [...] tests/faults/grow_script.py OUT

Trains the small float64 MLP of :func:`build` for :data:`STEPS` steps with the default (model-based)
controller, as docs/failures.md writes a resumable script: ``ol.load_checkpoint`` at the start, a checkpoint
every :data:`EVERY` steps and, when ``ol.should_stop`` turns true (the SIGTERM torchrun's agent sends its
workers when it re-forms the job for a node that joins), a final checkpoint, ``ol.close()`` and exit 143. The
run directory is ``OUT/run`` (``out=``, ``overwrite=False``: the re-formed job is the same job, whose record
goes on; before omnilearn/observe/samejob.py its rank 0 refused its own run directory, and the job re-formed once
more as a failure).

Per agent (environment): ``GROW_NODE`` names the node (A, B, C) in the rows; ``GROW_MS_PER_SAMPLE`` is what a
sample costs on it (a sleep inside the timed compute, before the forward: the emulated heterogeneity the
controller sees). While the job has fewer than ``GROW_WORLD`` workers it holds after ``GROW_HOLD_AT`` steps
until this process is told to stop (:func:`omnilearn.stopping.stop_requested`: its agent's SIGTERM; at most
:data:`HOLD_S`), so that the join lands at the same step whatever the machine's load, and the smaller job never
ends before the newcomer's agent is up.

Records: each process appends a line per step to ``OUT/rows-<node><local rank>.jsonl`` (``step``, ``world``,
``rank``, ``batch``: its share of that step, ``t``: when it ended), and one that stops writes
``OUT/stopped-<node><local rank>.json`` (``step``: the next step, saved; ``closed``: when it left); each job's
rank 0 writes ``OUT/attempt-<k>.json`` after its first step (k = 0, 1, ... in order: ``start``, ``world``, and
the times ``t0`` process start, ``imported``, ``setup``, ``loaded``, ``first_step``); the last job's rank 0
writes ``OUT/final.pt``.

Run: ``python -m pytest -q -s tests/faults/test_grow_torchrun.py``
"""

from __future__ import annotations

import time

T0 = time.time()  # before the imports: a restarted job's start-up is measured from here

import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import omnilearn
from omnilearn import stopping

T1 = time.time()  # the imports done
STEPS = 100
EVERY = 25
GLOBAL_BATCH, INTERVAL, LR = 24, 4, 0.05
HOLD_S = 120


def build() -> tuple[TensorDataset, nn.Module]:
    """The data and the model, in float64 (the test's one-process run builds the same)."""
    g = torch.Generator().manual_seed(7)
    f64 = torch.float64
    data = TensorDataset(torch.randn(480, 8, generator=g, dtype=f64), torch.randn(480, 1, generator=g, dtype=f64))
    torch.manual_seed(0)
    return data, nn.Sequential(nn.Linear(8, 16, dtype=f64), nn.Tanh(), nn.Linear(16, 1, dtype=f64))


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


class Records:
    """What the test reads (module docstring): every step's row, the job's attempt record, the stop."""

    def __init__(self, out: Path, node: str, record: dict) -> None:
        self.out, self.node, self.record = out, node, record
        self.rows = open(out / f"rows-{node}.jsonl", "a")

    def step(self, ol, batch: int) -> None:
        self.rows.write(json.dumps({"step": ol.next_step - 1, "world": ol.world_size, "rank": ol.rank,
                                    "batch": batch, "t": time.time()}) + "\n")
        self.rows.flush()
        if "first_step" not in self.record:
            self.record["first_step"] = time.time()
            if ol.is_main:  # numbered in order
                k = len(list(self.out.glob("attempt-*.json")))
                (self.out / f"attempt-{k}.json").write_text(json.dumps(self.record))

    def stopped(self, step: int) -> None:
        (self.out / f"stopped-{self.node}.json").write_text(json.dumps({"step": step, "closed": time.time()}))


def main(out: Path) -> None:
    node = os.environ.get("GROW_NODE", "A") + os.environ.get("LOCAL_RANK", "0")
    cost_s = float(os.environ.get("GROW_MS_PER_SAMPLE", "0")) / 1000
    grown, hold_at = int(os.environ.get("GROW_WORLD", "0")), int(os.environ.get("GROW_HOLD_AT", "0"))
    ol = omnilearn.setup(global_batch=GLOBAL_BATCH, control_interval=INTERVAL, total_steps=STEPS,
                         out=str(out / "run"), overwrite=False)
    data, model = build()
    model = ol.wrap_model(model)
    opt = optimizer(model)
    loader = ol.data_loader(data)
    times = {"t0": T0, "imported": T1, "setup": time.time()}
    ol.load_checkpoint(out / "ckpt", model=ol.module, optimizer=opt)
    records = Records(out, node, {"start": ol.next_step, "world": ol.world_size, **times, "loaded": time.time()})
    hold = ol.world_size < grown
    epoch = ol.epoch
    while ol.next_step < STEPS:
        loader.set_epoch(epoch)
        for x, y in loader:
            time.sleep(len(x) * cost_s)  # this node's emulated compute
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            ol.step(loss)
            records.step(ol, len(x))
            if hold and ol.next_step == hold_at:  # until the agent's SIGTERM: the stop is agreed a few steps on
                held = time.monotonic()
                while not stopping.stop_requested() and time.monotonic() - held < HOLD_S:
                    time.sleep(0.01)
            if ol.next_step % EVERY == 0:
                ol.save_checkpoint(out / "ckpt", model=ol.module, optimizer=opt)
            if ol.should_stop:  # the agent's SIGTERM reached some rank: every rank stops after this step
                ol.save_checkpoint(out / "ckpt", model=ol.module, optimizer=opt)
                ol.close()
                records.stopped(ol.next_step)
                raise SystemExit(stopping.exit_code())
            if ol.next_step >= STEPS:
                break
        epoch += 1
    ol.finish()
    if ol.is_main:
        torch.save(ol.module.state_dict(), out / "final.pt")
    ol.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]))

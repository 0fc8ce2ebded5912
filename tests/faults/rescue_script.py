"""A user's own script for tests/faults/test_rescue.py: the resume pattern of docs/failures.md, in float64.

    torchrun [...] tests/faults/rescue_script.py OUT [KILL_RANK:KILL_STEP[:agent][@ATTEMPT],...]

Trains a small float64 MLP on fixed random data for :data:`STEPS` steps with
the static split (the split is the declared speeds', not the timings'), a
periodic checkpoint that never comes within the run (``EVERY``), and
``ol.load_checkpoint`` at the start: so a restart resumes only from what the
survivors saved. In the first attempt, rank KILL_RANK SIGKILLs itself right
after step KILL_STEP - 1 (``ol.next_step == KILL_STEP``; ``L<r>`` for KILL_RANK:
local rank r of the agent that got the argument); with ``:agent`` it
SIGKILLs its torchrun agent's whole process group instead (its "node" dies);
with ``:update`` it dies right after its ``optimizer.step()`` of step
KILL_STEP, so its peers see the loss in the script's own logging collective
(``dist.all_reduce`` of the loss, between ``optimizer.step()`` and
``ol.step()``, in every step), with step KILL_STEP's update applied and not
counted. ``RESCUE_EVERY`` sets the periodic checkpoint's interval.
``@ATTEMPT`` kills in that attempt (``TORCHELASTIC_RESTART_COUNT``; default 0);
several kills are separated by commas (two failures in a row). Each
attempt's rank 0 writes ``OUT/attempt-<k>.json`` (k = 0, 1, ... in order) after its first step (where it
started, the world size, and the times: process start, set-up done,
checkpoint loaded, first step done), the killed rank ``OUT/kill-<k>.json``
(when); the last attempt's rank 0 writes ``OUT/final.pt`` (the weights). ``RESCUE_DEVICE=cuda`` trains on
one GPU per rank (NCCL: tests/gpu), ``RESCUE_TIMEOUT_S`` bounds the group's collectives.

Run: ``python -m pytest -q tests/faults/test_rescue.py``
"""

from __future__ import annotations

import time

T0 = time.time()  # before the imports: a restarted attempt's start-up is measured from here

import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import omnilearn

STEPS = 24
EVERY = int(os.environ.get("RESCUE_EVERY", "1000"))  # default: never within the run (only the survivors' save)


def whom(rank: str) -> bool:
    """Whether this process is the one to kill: ``R`` names a global rank, ``L<r>`` a local rank of this agent
    (each agent gets its own arguments: a test kills a rank of one "node")."""
    if rank.startswith("L"):
        return int(os.environ.get("LOCAL_RANK", "0")) == int(rank[1:])
    return int(os.environ.get("RANK", "0")) == int(rank)


def main(out: Path, kill: str | None) -> None:
    torch.set_default_dtype(torch.float64)
    g = torch.Generator().manual_seed(7)
    data = TensorDataset(torch.randn(480, 8, generator=g), torch.randn(480, 1, generator=g))
    device = os.environ.get("RESCUE_DEVICE", "cpu")  # cuda: NCCL, one GPU per rank (tests/gpu)
    ol = omnilearn.setup(global_batch=24, control_interval=4, controller="static", device=device,
                         total_steps=STEPS, timeout_s=float(os.environ.get("RESCUE_TIMEOUT_S", "300")))
    torch.manual_seed(0)
    model = ol.wrap_model(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = ol.data_loader(data)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    times = {"t0": T0, "setup": time.time()}
    ol.load_checkpoint(out / "ckpt", model=ol.module, optimizer=opt)
    times["loaded"] = time.time()
    record = {"start": ol.next_step, "world": ol.world_size, **times}
    kills = [k.split("@") for k in kill.split(",")] if kill else []
    mine = [k[0] for k in kills if int((k + ["0"])[1]) == attempt]
    rank, step, how = (mine[0].split(":") + ["proc"])[:3] if mine else (None, None, None)
    for epoch in range(ol.epoch, 100):
        loader.set_epoch(epoch)
        for x, y in loader:
            loss = F.mse_loss(model(x.to(ol.device)), y.to(ol.device))
            opt.zero_grad()
            loss.backward()
            opt.step()
            if rank is not None and how == "update" and whom(rank) and ol.next_step == int(step):
                os.kill(os.getpid(), signal.SIGKILL)  # step KILL_STEP applied, not counted; the peers log next
            logged = loss.detach().clone()
            if dist.is_initialized():
                dist.all_reduce(logged)  # the script's own logging collective
            ol.step(logged / ol.world_size)
            if "first_step" not in record:
                record["first_step"] = time.time()
                if ol.is_main:  # numbered in order: an agent that re-forms the job for a node does not count it
                    (out / f"attempt-{len(list(out.glob('attempt-*.json')))}.json").write_text(json.dumps(record))
            if rank is not None and how != "update" and whom(rank) and ol.next_step == int(step):
                (out / f"kill-{attempt}.json").write_text(json.dumps({"at": time.time(), "step": ol.next_step}))
                if how == "agent":  # the node dies: its agent's process group, then its workers' (their own)
                    os.killpg(os.getpgid(os.getppid()), signal.SIGKILL)
                os.killpg(os.getpgid(0), signal.SIGKILL) if how == "agent" else os.kill(os.getpid(), signal.SIGKILL)
            if ol.next_step % EVERY == 0:
                ol.save_checkpoint(out / "ckpt", model=ol.module, optimizer=opt)
            if ol.next_step >= STEPS:
                break
        if ol.next_step >= STEPS:
            break
    ol.finish()
    if ol.is_main:
        torch.save(ol.module.state_dict(), out / "final.pt")
    ol.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else None)

"""The core API's loop that the resume-at-every-step tests resume: float64, 3 epochs of 6 steps, SGD with momentum
and a per-step LR schedule (``StepLR``), ``ol.save_checkpoint`` / ``ol.load_checkpoint`` with all three.

Used by tests/unit/test_resume_every_step.py (one process, bitwise) and tests/dist/test_resume_every_step_elastic.py
(another worker count, <= 1e-12). Run either file.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import omnilearn

STEPS, PER_EPOCH = 18, 6


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(96, 5, generator=g, dtype=torch.float64),
                         torch.randn(96, 1, generator=g, dtype=torch.float64))


def train(save_to: Path | None = None, resume_from: Path | None = None,
          stop_at: int | None = None) -> dict[str, torch.Tensor]:
    """The loop from the start, or from the checkpoint in ``resume_from``, to the end (or to step ``stop_at``).
    With ``save_to`` it saves after every step but the last into ``save_to/<step>``; with ``stop_at`` too, only
    that step's, then it stops. The weights it ends with."""
    ol = omnilearn.setup(global_batch=16, device="cpu", handle_signals=False, seed=0, control_interval=3)
    torch.manual_seed(0)
    model = ol.wrap_model(torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)
    loader = ol.data_loader(data())
    if resume_from is not None:
        assert ol.load_checkpoint(resume_from, model=ol.module, optimizer=opt, scheduler=sched)
    end = stop_at or STEPS
    for epoch in range(ol.epoch, STEPS // PER_EPOCH):
        loader.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
            sched.step()
            ol.step()
            if save_to is not None and ol.next_step < STEPS and ol.next_step == (stop_at or ol.next_step):
                ol.save_checkpoint(save_to / str(ol.next_step), model=ol.module, optimizer=opt, scheduler=sched)
            if ol.next_step == end:
                break
        if ol.next_step == end:
            break
    assert ol.next_step == end
    weights = {k: v.detach().clone() for k, v in ol.module.state_dict().items()}
    ol.release()
    return weights

"""A resume at every step lands on the uninterrupted path: the core API, one process, float64.

A user's loop (``omnilearn.setup``, ``wrap_model``, ``data_loader`` with ``set_epoch``, SGD with momentum, a
per-step LR schedule, ``ol.save_checkpoint`` / ``ol.load_checkpoint``) of 3 epochs of 6 steps. For every step
k from 1 to 17 (inside an epoch, at each epoch boundary, one step before and after it, in the last epoch): a
session trains k steps and saves, a new session loads that checkpoint and trains to the end; its weights are
the uninterrupted run's, bitwise (one process: the same sums in the same order). What a resume at another worker
count gives is tests/faults/test_resume.py's and the rescue tests'; this holds every step at one.

Run: ``python -m pytest -q tests/unit/test_resume_every_step.py``
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import omnilearn

STEPS, PER_EPOCH = 18, 6


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(96, 5, generator=g, dtype=torch.float64),
                         torch.randn(96, 1, generator=g, dtype=torch.float64))


def train(directory, stop_at: int | None) -> dict[str, torch.Tensor]:
    """The loop; with ``stop_at`` it saves there and stops, else it resumes from ``directory`` (if it holds a
    checkpoint) and trains to the end. The weights it ends with."""
    ol = omnilearn.setup(global_batch=16, device="cpu", handle_signals=False, seed=0, control_interval=3)
    torch.manual_seed(0)
    model = ol.wrap_model(torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)
    loader = ol.data_loader(data())
    if stop_at is None:
        ol.load_checkpoint(directory, model=ol.module, optimizer=opt, scheduler=sched)
    for epoch in range(ol.epoch, STEPS // PER_EPOCH):
        loader.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
            sched.step()
            ol.step()
            if ol.next_step == stop_at:
                ol.save_checkpoint(directory, model=ol.module, optimizer=opt, scheduler=sched)
                break
        if ol.next_step in (stop_at, STEPS):
            break
    weights = {k: v.detach().clone() for k, v in ol.module.state_dict().items()}
    ol.release()
    return weights


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> dict[str, torch.Tensor]:
    return train(tmp_path_factory.mktemp("none"), None)


@pytest.mark.parametrize("k", range(1, STEPS))
def test_a_resume_after_step_k_ends_with_the_uninterrupted_weights(whole, tmp_path, k):
    train(tmp_path, k)
    resumed = train(tmp_path, None)
    assert resumed.keys() == whole.keys()
    for name in whole:
        assert torch.equal(resumed[name], whole[name]), (k, name, float((resumed[name] - whole[name]).abs().max()))

"""The quiet step's Python work, counted: OmniLearn's API loop over plain DDP's, in calls per step (no clock read).

A step's time moves by 10-30% from hour to hour on a shared host (docs/results.md, "The hot path"); the number
of calls it makes does not. Two ranks train the tiny MLP on the default job's data in the two loops of
``tools/hl1_breakdown.py`` (plain DDP with a ``DataLoader`` over a ``DistributedSampler``, and
``ol.data_loader`` / ``ol.wrap_model`` / ``ol.step``; its timing laps left out) and count every call a step
makes (``sys.setprofile``: Python functions and C builtins alike) over ``STEPS`` steps of each, with no window
end (a control interval longer than the run). OmniLearn's extra calls per step must stay within ``BUDGET``: a
change that adds work to every step (a clock read, a lookup through another layer, a per-step allocation
helper) fails here, on any host. ``tests/unit/test_step_cost.py`` counts ``ol.step()`` and the loader's
hand-out alone, in one process; this counts the whole step, DDP's forward and backward (the marks) included.

Run: ``python -m pytest -q tests/dist/test_hot_path.py``
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from ranks import start_ranks

from omnilearn.experiments.config import TrainConfig
from omnilearn.experiments.train import workload

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from hl1_breakdown import omni_loop, plain_loop  # noqa: E402  (the benchmark's own loops)

pytestmark = pytest.mark.dist
STEPS = 40
# extra calls a quiet step: 66.3 on 2026-12-07 with the exact weighting (issue 49: DDP's comm hook, a Python call per
# bucket, and the marks in the last bucket's call); 55.9 on 2026-11-28 with the inexact output hooks it replaced
BUDGET = 67


def calls(step, steps: int) -> int:
    """Calls (Python and C) that ``steps`` runs of ``step()`` make."""
    count = [0]

    def profile(_frame, event, _arg):
        if event in ("call", "c_call"):
            count[0] += 1

    sys.setprofile(profile)
    try:
        for _ in range(steps):
            step()
    finally:
        sys.setprofile(None)
    return count[0]


def _worker(rank: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    cfg = TrainConfig(workers=2, global_batch=256, device="cpu", model="mlp", control_interval=100_000)
    splits = workload.load_data(cfg)
    plain, (ol, omni) = plain_loop(cfg, splits, torch.device("cpu")), omni_loop(cfg, splits, 10 * STEPS)

    def step(loop):  # Loop.step without its timing laps
        x, y = next(loop.stream)
        loss = workload.criterion(loop.model(x), y)
        loss.backward()
        loop.opt.step()
        loop.opt.zero_grad(set_to_none=True)
        if loop.after is not None:
            loop.after(loss)

    for _ in range(3):  # warm: the last-ready parameter learned, the optimizers' state made
        step(plain)
        step(omni)
    counted = {name: calls(lambda: step(loop), STEPS) for name, loop in (("plain", plain), ("omni", omni))}
    assert ol.intervals == 0, "a window ended inside the counted steps: the count is not the quiet step's"
    ol.release()
    dist.destroy_process_group()
    torch.save(counted, f"{out}/rank{rank}.pt")


def test_the_quiet_step_makes_at_most_budget_calls_more_than_plain_ddp(tmp_path):
    start_ranks(_worker, (str(tmp_path / "store"), str(tmp_path)), 2)
    for rank in range(2):
        counted = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        extra = (counted["omni"] - counted["plain"]) / STEPS
        print(f"rank {rank}: plain DDP {counted['plain'] / STEPS:.1f} calls per step, OmniLearn {extra:+.1f}")
        assert extra <= BUDGET, f"rank {rank}: OmniLearn's quiet step makes {extra:.1f} calls more than plain DDP's"
        assert extra > 0  # the count sees OmniLearn's own calls (the loader, the hooks, ol.step)

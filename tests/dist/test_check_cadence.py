"""Meetings only where they pay: mid-interval checks (:func:`omnilearn.decisions.checks_pay`) and short
intervals stretched to whole intervals (:func:`omnilearn.decisions.window_steps`).

Two gloo ranks, the controller's timings scripted (``OMNILEARN_TEST_S_PER_SAMPLE``: no clock is read), a
control interval of 6 steps (a check every 2): at steps of 0.08 s (two steps between checks: 0.16 s, above
``CHECK_WINDOW_MIN_S``) every interval has its two checks; at steps of 0.08 ms the first interval has them (no
step time is known yet) and the later ones none. At 0.08 ms steps the interval (0.5 ms) is also far below
``min_window_s`` (0.15 s): after the warm-up's 4 intervals (``decisions.WARMUP_INTERVALS``; the controller,
``uniform``, changes nothing) the window is stretched to 8 intervals (48 steps), so the run's fifth window ends
at its last step; with ``min_window_s=0`` every interval ends after its 6 steps. Both travel in
the session state, so a resumed run holds the checks and the stretch as the run it continues did.

Run: ``python -m pytest -q tests/dist/test_check_cadence.py``
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from ranks import scripted_rank_results
from torch import nn
from torch.utils.data import TensorDataset

import omnilearn

pytestmark = pytest.mark.dist

STEPS, INTERVAL = 48, 6


def _rank(rank: int, out: str, store: str, min_window_s: float) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    ol = omnilearn.setup(global_batch=16, control_interval=INTERVAL, device="cpu", handle_signals=False,
                         controller="uniform", total_steps=STEPS, min_window_s=min_window_s)
    torch.manual_seed(0)
    model = ol.wrap_model(nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    checks: list[int] = []
    check = ol._check
    ol._check = lambda step: (checks.append(step), check(step))  # counts the checks the session starts
    ends: list[int] = []
    end = ol._end_interval
    ol._end_interval = lambda step: (ends.append(step), end(step))  # and the interval ends
    loader = ol.data_loader(data)
    done = 0
    while done < STEPS:
        for x, y in loader:
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            ol.step()
            done += 1
            if done == STEPS:
                break
    state = ol.state_dict()
    ol.finish()
    torch.save({"checks": checks, "ends": ends, "state_checks": state["checks"], "stretch": state["stretch"]},
               Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.parametrize("s_per_sample, min_window_s, checks, ends, stretch", [
    # 8 samples a step: 0.08 s steps, a check every 2 steps, intervals of 0.48 s
    ("0.01,0.01", 0.15, [s + i for s in range(0, 48, 6) for i in (1, 3)], list(range(5, 48, 6)), 1),
    # 0.08 ms steps: only the first interval's checks (no step time is known before it), then after the warm-up
    # one long window
    ("0.00001,0.00001", 0.15, [1, 3], [5, 11, 17, 23, 47], 8),
    ("0.00001,0.00001", 0.0, [1, 3], list(range(5, 48, 6)), 1),  # never stretched
])
def test_meetings_run_only_where_they_pay(tmp_path, s_per_sample, min_window_s, checks, ends, stretch):
    results = scripted_rank_results(_rank, (str(tmp_path), str(tmp_path / "store"), min_window_s), tmp_path,
                                    nprocs=2, times=s_per_sample)
    for r in results:
        assert r["checks"] == checks
        assert r["ends"] == ends
        assert r["state_checks"] is (len(checks) > 2)
        assert r["stretch"] == stretch

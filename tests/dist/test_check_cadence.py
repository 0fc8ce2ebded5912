"""Mid-interval checks run only where they pay for their meeting (:func:`omnilearn.decisions.checks_pay`).

Two gloo ranks, the controller's timings scripted (``OMNILEARN_TEST_S_PER_SAMPLE``: no clock is read), a
control interval of 6 steps (a check every 2): at steps of 0.08 s (two steps between checks: 0.16 s, above
``CHECK_WINDOW_MIN_S``) every interval has its two checks; at steps of 0.08 ms the first interval has them (no
step time is known yet) and the later ones none. The flag travels in the session state, so a resumed run
holds the checks as the run it continues did.

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

STEPS, INTERVAL = 24, 6


def _rank(rank: int, out: str, store: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    ol = omnilearn.setup(global_batch=16, control_interval=INTERVAL, device="cpu", handle_signals=False,
                         controller="uniform", total_steps=STEPS)
    torch.manual_seed(0)
    model = ol.wrap_model(nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    checks: list[int] = []
    check = ol._check
    ol._check = lambda step: (checks.append(step), check(step))  # counts the checks the session starts
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
    torch.save({"checks": checks, "state_checks": state["checks"]}, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.parametrize("s_per_sample, expected", [
    ("0.01,0.01", [1, 3, 7, 9, 13, 15, 19, 21]),  # 8 samples a step: 0.08 s steps, a check every 2 steps
    ("0.00001,0.00001", [1, 3]),  # 0.08 ms steps: only the first interval's (no step time known before it)
])
def test_checks_run_only_where_their_meeting_pays(tmp_path, s_per_sample, expected):
    results = scripted_rank_results(_rank, (str(tmp_path), str(tmp_path / "store")), tmp_path, nprocs=2,
                                    times=s_per_sample)
    for r in results:
        assert r["checks"] == expected
        assert r["state_checks"] is (len(expected) > 2)

"""Every rank takes the identical decision, and a divergence is caught: 2 real gloo workers, one spawn.

- Loader settings that differ per node: rank 0 reads in the main process,
  rank 1 with a worker process that prefetches 2 batches. Both plan with
  the deeper prefetch (lag 2), so with scripted timings that call for a
  change at the first interval end (step 5 of 8) both hold it ("would start
  at step 8 >= total steps 8") and end with the same schedule and loop plan
  (before: rank 0, with lag 0, registered the change and rank 1 did not).
- Datasets of different lengths: refused on every rank, naming the sizes
  and the ranks.
- A plan changed behind the session's back on rank 1 (a pending change in
  its schedule alone): the next meeting (the check after step 3) raises on
  every rank, naming rank 1.
- Token counts all zero on both ranks: a zero gradient under DDP's hook.

A 10 s group timeout turns a rank left waiting into an error, not a hang.
Run: ``python -m pytest -q tests/dist/test_agreement.py`` (~10 s).
"""

from __future__ import annotations

import json
import os
from datetime import timedelta

import pytest
from ranks import start_ranks
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import omnilearn
from omnilearn.decisions import SCRIPTED_ENV
from tokendata import PairData

pytestmark = pytest.mark.dist
B = 64


def different_loaders(rank: int, out: str) -> dict:
    """8 steps; rank 1's loader prefetches 2 batches in a worker process, rank 0's none."""
    os.environ[SCRIPTED_ENV] = "0.001,0.003"  # rank 1 three times slower: the controller wants a change
    ol = omnilearn.setup(global_batch=B, control_interval=6, total_steps=8, device="cpu",
                         out=f"{out}/lag" if rank == 0 else None)
    model = ol.wrap_model(nn.Linear(6, 3))
    loader = ol.data_loader(PairData(16 * B), num_workers=rank, prefetch_factor=2 if rank else None)
    for x, y in loader:
        F.cross_entropy(model(x), y).backward()
        ol.step()
    ol.finish()
    os.environ.pop(SCRIPTED_ENV)
    return {"lag": ol.loop.lag, "schedule": ol.schedule.state_dict(), "plan": list(ol.loop.batches)}


def different_lengths(rank: int) -> str:
    ol = omnilearn.setup(global_batch=B, device="cpu")
    ol.wrap_model(nn.Linear(6, 3))
    try:
        ol.data_loader(PairData(8 * B - 10 * rank))
    except ValueError as e:
        return str(e)
    return ""


def diverged_plan(rank: int) -> str:
    """Rank 1 registers a change for step 10 in its own schedule only, after step 2."""
    ol = omnilearn.setup(global_batch=B, control_interval=6, total_steps=12, deadband=0.99, device="cpu")
    model = ol.wrap_model(nn.Linear(6, 3))
    try:
        for step, (x, y) in enumerate(ol.data_loader(PairData(16 * B))):
            F.cross_entropy(model(x), y).backward()
            ol.step()
            if step == 2 and rank == 1:
                ol.schedule.change(10, (40, 24))
    except RuntimeError as e:
        return str(e)
    return ""


def zero_counts() -> list[torch.Tensor]:
    ol = omnilearn.setup(global_batch=B, device="cpu")
    model = ol.wrap_model(nn.Linear(6, 3))
    x, y = next(iter(ol.data_loader(PairData(4 * B))))
    ol.backward(F.cross_entropy(model(x), y) * 0.0, count=0)  # a finite loss over no token, on every rank
    return [p.grad.clone() for p in model.parameters()]


def _worker(rank: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=10))
    result = {"loaders": different_loaders(rank, out), "lengths": different_lengths(rank),
              "diverged": diverged_plan(rank), "zero": zero_counts()}
    torch.save(result, f"{out}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("agreement")
    start_ranks(_worker, (str(out / "store"), str(out)), 2)
    events = [json.loads(line) for line in (out / "lag" / "metrics.jsonl").read_text().splitlines()]
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)], events


def test_ranks_with_different_loader_settings_plan_with_the_same_lag(ranks):
    (a, b), events = ranks
    assert (a["loaders"]["plan"], a["loaders"]["schedule"]) == (b["loaders"]["plan"], b["loaders"]["schedule"])
    assert a["loaders"]["lag"] == b["loaders"]["lag"] == 2  # the deeper prefetch: rank 1's 1 worker x 2
    first = next(e for e in events if e["event"] == "decision")
    assert first["step"] == 6 and not first["changed"]  # the interval's end (step 5), read a step later
    assert "would start at step 9 >= total steps 8" in first["reason"], first  # wanted, but too late for lag 2


def test_datasets_of_different_lengths_are_refused_on_every_rank(ranks):
    (a, b), _ = ranks
    for said in (a["lengths"], b["lengths"]):
        assert said.startswith("the ranks' datasets differ in size (512 on ranks [0]; 502 on ranks [1])"), said
        assert "\n" not in said


def test_a_plan_that_diverges_is_caught_at_the_next_meeting_naming_the_rank(ranks):
    (a, b), _ = ranks
    for said in (a["diverged"], b["diverged"]):
        assert said.startswith("ranks [1] hold a batch plan other than rank 0's at a check within a control "
                               "interval after 4 steps"), said


def test_token_counts_all_zero_everywhere_give_a_zero_gradient(ranks):
    (a, b), _ = ranks
    for grads in (a["zero"], b["zero"]):
        assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)  # was 0 x (c / 0): NaN

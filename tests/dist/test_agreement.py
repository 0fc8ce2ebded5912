"""Every rank takes the identical decision, and a divergence is caught: 2 real gloo workers, one spawn.

- Loader settings that differ per node: rank 0 reads in the main process,
  rank 1 with a worker process that prefetches 2 batches. Both plan with
  the deeper prefetch (lag 2), so with scripted timings that call for a
  change at the first interval end (step 5 of 8, read at step 6) both hold
  it ("would start at step 9 >= total steps 8") and end with the same
  schedule and loop plan (before: rank 0, with lag 0, registered the change
  and rank 1 did not).
- A loop that fetches deeper ahead right after a meeting started (rank 1
  takes three more batches after step 5): it reads the pending meeting
  before sampling past its promise, so the change lands at step 7 on both
  ranks, on no step already sampled, and every step's slices agree.
- Datasets of different lengths: refused on every rank, naming the sizes
  and the ranks.
- A plan changed behind the session's back on rank 1 (a pending change in
  its schedule alone): the next meeting (the check after step 3) raises on
  every rank, naming rank 1.
- Token counts all zero on both ranks: a zero gradient under DDP's hook.

A 120 s group timeout turns a rank left waiting into an error, not a hang (no check here waits on it: a
10 s one could lapse on a busy host while the other rank starts its loader's worker process).
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


def deepening_fetch(rank: int) -> dict:
    """24 steps, control interval 6; after step 5 (an interval's end: its meeting is in flight) rank 1 fetches
    three more batches at once, sampling steps 7 to 9 before the meeting is read."""
    os.environ[SCRIPTED_ENV] = "0.001,0.003"  # rank 1 three times slower: a change at the first interval end
    ol = omnilearn.setup(global_batch=B, control_interval=6, total_steps=24, deadband=0.01, device="cpu")
    model = ol.wrap_model(nn.Linear(6, 3))
    it = iter(ol.data_loader(PairData(32 * B)))  # one epoch holds the 24 steps
    fetched, seen = [next(it)], []
    for step in range(24):
        x, y = fetched.pop(0)
        seen.append(len(x))
        F.cross_entropy(model(x), y).backward()
        ol.step()
        wanted = 4 if step == 5 and rank == 1 else 1  # three ahead at once, then one at a time again
        while len(fetched) < wanted and ol.steps_done + len(fetched) < 24:
            fetched.append(next(it))
    ol.finish()
    os.environ.pop(SCRIPTED_ENV)
    return {"schedule": ol.schedule.state_dict(), "seen": seen}


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
                            timeout=timedelta(seconds=120))
    result = {"loaders": different_loaders(rank, out), "deepening": deepening_fetch(rank),
              "lengths": different_lengths(rank),
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


def test_a_loop_that_fetches_deeper_before_a_meeting_is_read_lands_the_change_on_no_sampled_step(ranks):
    (a, b), _ = ranks
    assert a["deepening"]["schedule"] == b["deepening"]["schedule"]
    starts, plans = a["deepening"]["schedule"]["starts"], a["deepening"]["schedule"]["plans"]
    # from step 7 (the interval ended at 5, read as at 6): rank 1 sampled 7 only after deciding (without the hold
    # it sampled 7 to 9 on the old plan and the read at step 6 failed: "batch change for step 7 arrives after...")
    assert starts[:2] == [0, 7] and plans[1][0] > plans[1][1]
    for r, got in enumerate((a, b)):  # each rank trained on the planned slice of every step
        planned = [plans[max(i for i, s in enumerate(starts) if s <= step)][r] for step in range(24)]
        assert got["deepening"]["seen"] == planned


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

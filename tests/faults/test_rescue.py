"""A crash costs one step, with ``omnilearn train``: the survivors save the last completed step, the restart
resumes there, and the run ends with the uninterrupted run's weights. Real worker processes, real SIGKILLs.

- Worker rank 1 SIGKILLs itself after step 16 (``OMNILEARN_FAULT_KILL_AT=1:17``) with no periodic checkpoint
  due (``--checkpoint-every 1000``): rank 0's next collective fails, it saves step 17, says so in one line,
  and ``--max-restarts 1`` resumes at step 17, bitwise the weights of the run never killed (same split:
  ``--controller static``).
- Rank 0 killed (it writes the run directory) with 3 workers: ranks 1 and 2 each try to save step 17, one
  writes it, the other says so; the restart resumes there (relative 1e-6: three ranks' sums round in
  another order after DDP's buckets are rebuilt).
- Killed during that save (``OMNILEARN_FAULT_RESCUE=kill``: between its ``.pt`` and its manifest): the cut
  save does not count, the restart takes the periodic checkpoint of step 10, still ends exact, and the next
  save sweeps the cut one.
- Rank 1 hangs after step 16 (``OMNILEARN_FAULT_HANG_AT``: SIGSTOP, no error anywhere): rank 0 waits in step
  17's all-reduce until the heartbeat watchdog names rank 1 (``--heartbeat-s 3``); before the verdict ends rank
  0, it saves step 17 from the watchdog's thread (the main thread waits in the all-reduce: nothing moves), and
  the restart resumes there, bitwise the uninterrupted run's weights.

The torchrun doors (one agent; two agents with a c10d rendezvous, one losing its node) are in
tests/faults/test_rescue_torchrun.py; the pieces in one process in tests/unit/test_survivor_save.py.

Run: ``python -m pytest -q tests/faults/test_rescue.py``
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from runfiles import raw_events

from omnilearn.checkpoint import CheckpointStore
from omnilearn.experiments.cli import main

BASE = ("--workers", "2", "--speeds", "2,1", "--controller", "static", "--max-steps", "30",
        "--control-interval", "5", "--global-batch", "256", "--no-plots")


def train(out: Path, *flags: str) -> int:
    return main(["train", "--out", str(out), *BASE, *flags])


def rel_diff(a: Path, b: Path) -> float:
    wa, wb = (torch.load(p / "model.pt", weights_only=True) for p in (a, b))
    num = sum(float(((wa[k].double() - wb[k].double()) ** 2).sum()) for k in wa) ** 0.5
    return num / sum(float((wa[k].double() ** 2).sum()) for k in wa) ** 0.5


def same_weights(a: Path, b: Path) -> bool:
    wa, wb = (torch.load(p / "model.pt", weights_only=True) for p in (a, b))
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("whole") / "run"
    assert train(out, "--checkpoint-every", "1000") == 0
    return out


@pytest.mark.parametrize("at", [17, 15], ids=["mid-interval", "at-the-interval-end"])
def test_a_killed_worker_costs_the_step_in_flight(whole, tmp_path, monkeypatch, capfd, at):
    """Mid-interval (after step 16) rank 0 next waits in step 17's gradient all-reduce; at the interval's end
    (after step 14, the 3rd interval of 5) the interval's meeting is in flight too (rank 0 reads it in step 15)."""
    monkeypatch.setenv("OMNILEARN_FAULT_KILL_AT", f"1:{at}")
    run = tmp_path / "run"
    assert train(run, "--checkpoint-every", "1000", "--max-restarts", "1") == 0
    err = capfd.readouterr().err
    assert f"omnilearn: rank 0 lost a peer at step {at} (" in err
    assert f"saved the checkpoint of step {at}" in err
    assert f"restart 1 of 1 from the checkpoint of step {at}" in err
    store = CheckpointStore(run / "checkpoints")
    assert at in store.steps()
    assert store.manifest(at)["meta"]["rescue"]["rank"] == 0
    assert [e["step"] for e in raw_events(run, "resume")] == [at]
    assert same_weights(whole, run)
    # the record counts every step trained, the rescued open window's too (its rows are not kept)
    assert json.loads((run / "summary.json").read_text())["steps"] == 30


def test_rank_zero_killed_the_others_save(whole, tmp_path, monkeypatch, capfd):
    """Rank 0 (which writes the run directory) dies: ranks 1 and 2 each try to save step 17, one writes it."""
    monkeypatch.setenv("OMNILEARN_FAULT_KILL_AT", "0:17")
    run = tmp_path / "run"
    flags = ("--checkpoint-every", "1000", "--max-restarts", "1", "--workers", "3", "--speeds", "2,1,1")
    assert train(run, *flags) == 0
    err = capfd.readouterr().err
    assert err.count("saved the checkpoint of step 17") + err.count("is saved by another survivor") == 2
    assert "restart 1 of 1 from the checkpoint of step 17" in err
    assert CheckpointStore(run / "checkpoints").manifest(17)["meta"]["rescue"]["rank"] in (1, 2)
    monkeypatch.delenv("OMNILEARN_FAULT_KILL_AT")
    whole3 = tmp_path / "whole3"
    assert train(whole3, "--checkpoint-every", "1000", "--workers", "3", "--speeds", "2,1,1") == 0
    assert rel_diff(whole3, run) < 1e-6  # three ranks: DDP's bucket order after a restart moves the sum's rounding


def test_a_kill_during_the_survivors_save_leaves_no_checkpoint_that_counts(whole, tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("OMNILEARN_FAULT_KILL_AT", "1:17")
    monkeypatch.setenv("OMNILEARN_FAULT_RESCUE", "kill")
    run = tmp_path / "run"
    assert train(run, "--checkpoint-every", "10", "--max-restarts", "1") == 0
    err = capfd.readouterr().err
    assert "restart 1 of 1 from the checkpoint of step 10" in err
    assert [e["step"] for e in raw_events(run, "resume")] == [10]
    store = CheckpointStore(run / "checkpoints")
    assert 17 not in store.steps()
    assert not store.path(17).exists()  # the cut .pt was swept by the next save
    assert not list((run / "checkpoints").glob(".*"))  # nor a claim or a temporary file left
    assert same_weights(whole, run)


def test_a_hung_peer_named_by_the_watchdog_costs_one_step_too(whole, tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("OMNILEARN_FAULT_HANG_AT", "1:17")
    run = tmp_path / "run"
    assert train(run, "--checkpoint-every", "1000", "--max-restarts", "1", "--heartbeat-s", "3") == 0
    err = capfd.readouterr().err
    assert "omnilearn: rank 0 lost a peer at step 17 (worker rank 1 stopped answering: no heartbeat" in err
    assert "restart 1 of 1 from the checkpoint of step 17" in err
    assert [e["step"] for e in raw_events(run, "resume")] == [17]
    assert same_weights(whole, run)

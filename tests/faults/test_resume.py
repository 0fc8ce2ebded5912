"""Checkpoints, exact resume, elastic resume and automatic restarts, with real worker processes.

- A run stopped after its checkpoint at step k and resumed (``--resume``)
  ends with the weights of a run never stopped: bitwise, when both use the
  same split (``--controller static``: the split is a function of the
  declared speeds, not of timings).
- Resumed with fewer or more workers (elastic) it still ends with the same
  weights up to float rounding (relative < 1e-5): the samples of a step do
  not depend on the split. Only the per-worker float sums differ; over long
  runs those rounding differences can grow (docs/failures.md has figures),
  so the comparison horizon is short.
- ``OMNILEARN_FAULT_KILL_AT`` SIGKILLs a worker mid-run; ``--max-restarts 1``
  restarts the run from its latest checkpoint (the one the survivor saved at
  the step in flight: :mod:`omnilearn.bsp.rescue`) and it completes with the
  uninterrupted run's weights; without restarts the launcher fails naming it.
- The resumed run's metrics are appended after a ``resume`` event, and
  ``omnilearn report`` reads the run.
- A resume never quietly becomes a fresh start: a damaged newest checkpoint
  falls back to the one before; every checkpoint damaged, or one that passed
  its checksum and does not load, fails the run naming the file (nothing
  written, no checkpoint pruned); no checkpoint at all starts over saying so.

Run: ``python -m pytest -q tests/faults/test_resume.py``
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from ranks import free_port
from runfiles import after_last_resume, raw_events, stopped_at

from omnilearn import checkpoint
from omnilearn.checkpoint import CheckpointStore
from omnilearn.decisions import SCRIPTED_ENV
from omnilearn.experiments.cli import main

BASE = ("--speeds", "2,1", "--controller", "static", "--max-steps", "30", "--checkpoint-every", "10",
        "--control-interval", "5", "--global-batch", "256", "--no-plots")


def train(out: Path, *flags: str, workers: int = 2) -> int:
    return main(["train", "--out", str(out), "--workers", str(workers), *BASE, *flags])


def rel_diff(a: Path, b: Path) -> float:
    wa, wb = (torch.load(p / "model.pt", weights_only=True) for p in (a, b))
    num = sum(((wa[k].double() - wb[k].double()) ** 2).sum() for k in wa) ** 0.5
    rel = float(num / sum((wa[k].double() ** 2).sum() for k in wa) ** 0.5)
    print(f"relative weight difference {rel:.3g}")
    return rel


def events(run: Path, kind: str) -> list[dict]:
    return raw_events(run, kind)


def after_resume(run: Path, kind: str) -> list[dict]:
    return after_last_resume(run, kind)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("whole") / "run"
    assert train(out) == 0
    return out


def test_checkpoints_are_kept_and_complete(uninterrupted):
    store = CheckpointStore(uninterrupted / "checkpoints")
    assert store.steps() == [10, 20, 30]
    step, state = store.load_latest()
    assert step == 30 and state["session"]["next_step"] == 30
    assert set(state) >= {"session", "model", "optimizer", "scheduler"}
    assert state["session"]["rank1"]["rng"]["torch"].dtype == torch.uint8  # every rank's own part is in


def test_resume_same_workers_is_exact(uninterrupted, tmp_path):
    run = stopped_at(uninterrupted, tmp_path / "run", 10)
    assert main(["train", "--out", str(run), "--resume", "--no-plots"]) == 0
    assert rel_diff(uninterrupted, run) < 1e-6
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 30 and summary["resumed_at_step"] == 10
    assert [e["step"] for e in events(run, "resume")] == [10]
    redone = [e["step"] for e in events(run, "step") if e["rank"] == 0]
    assert redone.count(15) == 2 and redone.count(5) == 1  # steps after the checkpoint were recorded twice


def test_a_checkpoint_inside_a_stretched_window_resumes_exactly(tmp_path, monkeypatch):
    """Scripted 0.26 ms steps: after the warm-up's 4 intervals of 4 steps the window is stretched to 8 intervals
    (steps 16-47). A due checkpoint is saved where an unstretched run would end an interval (20, 32: inside the
    window, the buffers synced first), and a resume from the one at 32 goes on exactly, in the same window."""
    monkeypatch.setenv(SCRIPTED_ENV, "0.000001,0.000001")
    flags = ("--max-steps", "40", "--control-interval", "4")
    whole = tmp_path / "whole"
    assert train(whole, *flags) == 0
    assert [e["step"] for e in events(whole, "decision")] == [4, 8, 12, 16, 40]  # read a step after each end
    assert CheckpointStore(whole / "checkpoints").steps() == [20, 32, 40]  # 12 was the oldest of 4: pruned
    run = stopped_at(whole, tmp_path / "run", 32)
    assert main(["train", "--out", str(run), "--resume", "--no-plots"]) == 0
    assert rel_diff(whole, run) == 0.0
    assert [e["step"] for e in after_resume(run, "decision")] == [40]  # the restored window, not a new one


@pytest.mark.parametrize("workers", [1, 3])
def test_resume_at_another_worker_count(uninterrupted, tmp_path, workers):
    run = stopped_at(uninterrupted, tmp_path / "run", 10)
    code = main(["train", "--out", str(run), "--resume", "--workers", str(workers), "--no-plots"])
    assert code == 0
    assert rel_diff(uninterrupted, run) < 1e-5
    resume = events(run, "resume")[-1]
    assert (resume["step"], resume["workers"], resume["from_workers"]) == (10, workers, 2)
    assert {e["rank"] for e in after_resume(run, "step")} == set(range(workers))


def test_resume_refuses_a_changed_learning_setting(uninterrupted, tmp_path, capsys):
    run = stopped_at(uninterrupted, tmp_path / "run", 10)
    assert main(["train", "--out", str(run), "--resume", "--lr", "0.2"]) == 2
    err = capsys.readouterr().err
    assert "--lr 0.2" in err and "differs from the run's 0.05" in err
    assert not (run / "model.pt").exists()


def test_kill9_restarts_from_the_checkpoint(uninterrupted, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OMNILEARN_FAULT_KILL_AT", "1:17")
    run = tmp_path / "run"
    assert train(run, "--max-restarts", "1") == 0
    err = capsys.readouterr().err
    assert "restart 1 of 1 from the checkpoint of step 17" in err  # the survivor's save (tests/faults/test_rescue.py)
    assert rel_diff(uninterrupted, run) < 1e-6
    assert [e["step"] for e in events(run, "resume")] == [17]
    assert (run / "failures" / "attempt-1").is_dir()  # the failed attempt's error logs are kept apart


def test_kill9_without_restarts_fails_naming_the_rank(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OMNILEARN_FAULT_KILL_AT", "1:7")
    assert train(tmp_path / "run") == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("omnilearn: error: worker rank 1")


def test_torchrun_restart_resumes(uninterrupted, tmp_path):
    """torchrun --max-restarts 1 after a kill -9: the restarted ranks resume from the checkpoint.

    The static rendezvous is the one whose restarts used to fail in gloo's
    connectFullMesh (stale peer addresses in the agent's store). The c10d
    rendezvous with two agents is tests/faults/test_rescue_torchrun.py.
    """
    rdzv = ["--nnodes", "1", "--master-port", str(free_port())]
    run = tmp_path / "run"
    env = {**os.environ, "OMNILEARN_FAULT_KILL_AT": "1:17"}
    cmd = [sys.executable, "-m", "torch.distributed.run", *rdzv, "--nproc-per-node", "2", "--max-restarts", "1",
           "-m", "omnilearn", "train", "--out", str(run), *BASE]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert [e["step"] for e in events(run, "resume")] == [17]  # the survivor saved step 17 before the agent's restart
    assert rel_diff(uninterrupted, run) < 1e-6


def test_a_corrupt_latest_checkpoint_falls_back(uninterrupted, tmp_path, capfd):
    run = stopped_at(uninterrupted, tmp_path / "run", 20)
    latest = CheckpointStore(run / "checkpoints").path(20)
    data = bytearray(latest.read_bytes())
    data[len(data) // 3] ^= 0x55
    latest.write_bytes(bytes(data))
    assert main(["train", "--out", str(run), "--resume", "--no-plots"]) == 0
    assert "step-000000020.pt is damaged: its checksum does not match" in capfd.readouterr().err
    assert [e["step"] for e in events(run, "resume")] == [10]
    assert rel_diff(uninterrupted, run) < 1e-6


def checkpoint_files(run: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((run / "checkpoints").iterdir())}


def test_a_checksummed_checkpoint_that_does_not_load_fails_the_resume_naming_it(uninterrupted, tmp_path,
                                                                                 monkeypatch, capfd):
    """Written without the save check (an older version): no fallback to step 10, no fresh start."""
    run = stopped_at(uninterrupted, tmp_path / "run", 20)
    store = CheckpointStore(run / "checkpoints")
    state = store.load(20)
    state["extra"] = {"best": np.float64(0.5)}
    with monkeypatch.context() as m:
        m.setattr(checkpoint, "first_refused", lambda state: None)
        store.save(20, state)
    before = checkpoint_files(run)
    assert main(["train", "--out", str(run), "--resume", "--no-plots"]) == 1
    err = capfd.readouterr().err.strip().splitlines()[-1]
    assert store.data_path(20).name == "step-000000020.g1.pt"  # step 20 saved again: the other generation
    assert "step-000000020.g1.pt passed its checksum but extra['best'] holds a numpy" in err, err
    assert checkpoint_files(run) == before and not (run / "model.pt").exists() and not events(run, "resume")


def test_resume_with_every_checkpoint_damaged_fails_instead_of_starting_over(uninterrupted, tmp_path, capfd):
    run = stopped_at(uninterrupted, tmp_path / "run", 20)
    for step in (10, 20):
        path = CheckpointStore(run / "checkpoints").path(step)
        path.write_bytes(path.read_bytes()[:-10])
    assert main(["train", "--out", str(run), "--resume", "--no-plots"]) == 1
    err = capfd.readouterr().err
    assert "no usable checkpoint in" in err.strip().splitlines()[-1] and "all 2 are damaged" in err
    assert not (run / "model.pt").exists() and not events(run, "resume")
    assert CheckpointStore(run / "checkpoints").steps() == [10, 20]  # left in place: the next try fails the same way


def test_resume_before_any_checkpoint_starts_over_saying_so(uninterrupted, tmp_path, capfd):
    run = stopped_at(uninterrupted, tmp_path / "run", 0)  # no checkpoint was complete
    assert main(["train", "--out", str(run), "--resume", "--no-plots"]) == 0
    err = capfd.readouterr().err
    assert "omnilearn: warning: --resume: no checkpoint in" in err and "starting over from step 0" in err
    assert [e["step"] for e in events(run, "resume")] == [0]

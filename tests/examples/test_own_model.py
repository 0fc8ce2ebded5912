"""``examples/own_model.py`` (your own model and dataset, gradient accumulation) under torchrun, rank 1 3x slower;
and its stop path: SIGTERM, a final checkpoint, the same command resuming it.

Run: ``python -m pytest -q tests/examples/test_own_model.py``
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import omnilearn
from omnilearn.observe.metrics import read_metrics
from runexample import EXAMPLES, assert_balanced_and_learning, scripted_timings, torchrun

pytestmark = pytest.mark.dist
GUARD_S = 300  # a hang guard, never a deadline


def test_own_model_example_rebalances_and_learns_with_accumulation(tmp_path):
    out = tmp_path / "run"
    done = torchrun("own_model.py", "--speeds", "3,1", "--epochs", "1", "--accumulation-steps", "2", "--out", str(out),
                    env=scripted_timings("3,1"))
    summary = assert_balanced_and_learning(out)
    changes = [d for d in read_metrics(out, "decision") if d["changed"]]
    assert changes and all(sum(d["new"]) == 128 for d in changes)
    assert summary["test_accuracy"] > 0.4  # four classes: it learned something
    assert "final batches" in done.stdout


def _steps(run: Path) -> int:
    """How many step rows rank 0 has written so far."""
    rows = run / "steps" / "rank-0.jsonl"
    return rows.read_text().count('"event":"step"') if rows.exists() else 0


def test_sigterm_stops_own_model_after_a_final_checkpoint_and_the_same_command_resumes_it(tmp_path):
    """The example's own stop path (``if ol.should_stop``), run as users run it: SIGTERM to ``torchrun`` once the
    job trains; the ranks stop together at the next control-interval end after the checkpoint of that step (torchrun
    exits 1, as it re-raises what it got, with its own traceback); the same command again resumes at that step, keeps the run record of the steps before
    and finishes. Nothing is timed: the waits are hang guards."""
    out, ckpt, log = tmp_path / "run", tmp_path / "ckpt", tmp_path / "torchrun.log"
    args = ("--epochs", "2", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1000", "--out", str(out))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(EXAMPLES / "own_model.py"), *args]
    with open(log, "wb") as f:
        job = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        for _ in range(int(GUARD_S / 0.1)):
            if job.poll() is not None or _steps(out) >= 3:
                break
            time.sleep(0.1)
        assert job.poll() is None, log.read_text()[-3000:]
        job.send_signal(signal.SIGTERM)  # to torchrun alone: it forwards it to both ranks
        code = job.wait(timeout=GUARD_S)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    said = log.read_text()
    assert code == 1 and "SIGTERM received: stopping after the next control interval end" in said, said[-3000:]
    ol = omnilearn.setup(global_batch=128, device="cpu", handle_signals=False)
    assert ol.load_checkpoint(ckpt)
    stopped = ol.next_step
    ol.release()
    assert 3 <= stopped < 64, stopped
    torchrun("own_model.py", *args)  # the same command: resumes at the stop
    assert [e["step"] for e in read_metrics(out, "resume")] == [stopped]
    rows = [r["step"] for r in read_metrics(out, "step") if r["rank"] == 0]
    assert rows == list(range(64)), rows  # the record of the steps before the stop kept, each step once
    assert json.loads((out / "summary.json").read_text())["steps"] == 64

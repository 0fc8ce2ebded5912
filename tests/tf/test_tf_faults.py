"""A TensorFlow run that loses a worker, or is told to stop: one line naming the cause, no worker left behind.

A worker killed mid-run (``OMNILEARN_FAULT_KILL_AT``) leaves its peers
waiting in a collective: the launcher sees the death, stops them (SIGTERM,
then SIGKILL) and names the dead worker. SIGTERM to the launcher stops
every worker at the same step, exit 143. A worker that hangs (SIGSTOP) stops
beating: the launcher names it after ``--heartbeat-s`` and, with
``--max-restarts``, restarts every worker from the newest checkpoint.

Run: ``python -m pytest -q tests/tf/test_tf_faults.py``
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from needs import needs
from runfiles import has_step_rows

pytestmark = [pytest.mark.dist, needs("tensorflow", "tensorflow")]


def launch(out, *flags: str, env: dict | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "omnilearn", "train", "--framework", "tensorflow", "--out", str(out), "--no-plots",
           *flags]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})


def no_worker_left(out) -> bool:
    """No process still runs the job of ``out`` (pgrep on its command line)."""
    found = subprocess.run(["pgrep", "-f", f"omnilearn.experiments.train.tfjob {out}"], capture_output=True, text=True)
    return found.stdout.strip() == ""


def test_a_dead_worker_fails_the_run_naming_it(tmp_path):
    out = tmp_path / "run"
    p = launch(out, "--speeds", "2,1,1", "--max-steps", "60", env={"OMNILEARN_FAULT_KILL_AT": "1:10"})
    stdout, stderr = p.communicate(timeout=240)
    assert p.returncode == 1, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("omnilearn: error: TensorFlow worker 1 failed (killed by SIGKILL)"), stderr[-3000:]
    assert "Traceback" not in stderr and no_worker_left(out)
    assert not (out / "summary.json").exists()


def test_sigterm_to_the_launcher_stops_every_worker(tmp_path):
    out = tmp_path / "run"
    p = launch(out, "--speeds", "2,1", "--max-steps", "100000")
    deadline = time.monotonic() + 600  # a hang guard; a launcher that ended early is seen at once
    while time.monotonic() < deadline and p.poll() is None and not has_step_rows(out):
        time.sleep(0.2)  # training has started
    assert p.poll() is None, p.communicate()[1][-3000:]
    p.send_signal(signal.SIGTERM)
    stdout, stderr = p.communicate(timeout=600)  # a hang guard, not a deadline
    assert p.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "stopped by SIGTERM" in stderr and "Traceback" not in stderr and no_worker_left(out)
    # every worker saw the signal (TensorFlow's own SIGTERM handler was put back): a checkpoint at the stop
    said = (out / "tf-worker0.log").read_text()
    assert "SIGTERM received: stopped at step" in said and "after a checkpoint; continue with --resume" in said, \
        f"{said[-2000:]}\n--- worker 1:\n{(out / 'tf-worker1.log').read_text()[-2000:]}\n--- launcher:\n{stderr[-2000:]}"
    assert len(list((out / "checkpoints").glob("step-*/session.json"))) == 1


def test_a_hung_worker_is_named_within_the_heartbeat_and_the_restart_finishes_the_run(tmp_path):
    """Worker 1 SIGSTOPs itself at step 12 (``OMNILEARN_FAULT_HANG_AT``): its heartbeat stops, the launcher names
    it after ``--heartbeat-s 3`` (not after the collective timeout of 300 s), stops every worker and restarts
    them from the checkpoint of step 10 (``--max-restarts 1``); the run ends."""
    out = tmp_path / "run"
    p = launch(out, "--speeds", "2,1", "--max-steps", "30", "--control-interval", "5", "--checkpoint-every", "10",
               "--heartbeat-s", "3", "--max-restarts", "1", env={"OMNILEARN_FAULT_HANG_AT": "1:12"})
    stdout, stderr = p.communicate(timeout=240)
    assert p.returncode == 0, stderr[-3000:]
    hung = re.search(r"TensorFlow worker 1 hung: no heartbeat for (\d+) s", stderr)
    assert hung and 3 <= int(hung.group(1)) <= 10, stderr[-3000:]
    assert "restart 1 of 1 from the checkpoint of step 10" in stderr and no_worker_left(out)
    assert "resumed at step 10 with 2 workers" in stdout and "Traceback" not in stderr
    assert json.loads((out / "summary.json").read_text())["steps"] == 30
    assert not list(out.glob(".beat-*"))

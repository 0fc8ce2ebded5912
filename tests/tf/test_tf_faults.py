"""A TensorFlow run that loses a worker, or is told to stop: one line naming the cause, no worker left behind.

A worker killed mid-run (``OMNILEARN_FAULT_KILL_AT``) leaves its peers
waiting in a collective: the launcher sees the death, stops them (SIGTERM,
then SIGKILL) and names the dead worker. SIGTERM to the launcher stops
every worker at the same step, exit 143.

Run: ``python -m pytest -q tests/tf/test_tf_faults.py``
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("tensorflow", reason="the [tensorflow] extra is not installed")
pytestmark = pytest.mark.dist


def launch(out, *flags: str, env: dict | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "omnilearn", "train", "--framework", "tensorflow", "--out", str(out), "--no-plots",
           *flags]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})


def no_worker_left(out) -> bool:
    """No process still runs the job of ``out`` (pgrep on its command line)."""
    found = subprocess.run(["pgrep", "-f", f"omnilearn.experiments.tfjob {out}"], capture_output=True, text=True)
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
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and not (out / "metrics.jsonl").exists():
        time.sleep(0.2)
    while time.monotonic() < deadline and '"event":"step"' not in (out / "metrics.jsonl").read_text():
        time.sleep(0.2)  # training has started
    p.send_signal(signal.SIGTERM)
    stdout, stderr = p.communicate(timeout=120)
    assert p.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "stopped by SIGTERM" in stderr and "Traceback" not in stderr and no_worker_left(out)

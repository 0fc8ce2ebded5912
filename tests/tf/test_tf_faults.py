"""A TensorFlow run that loses a worker, or is told to stop: one line naming the cause, no worker left behind.

A worker killed mid-run (``OMNILEARN_FAULT_KILL_AT``) leaves its peers
waiting in a collective: the launcher sees the death, stops them (SIGTERM,
then SIGKILL) and names the dead worker. SIGTERM to the launcher stops
every worker at the same step, exit 143; while it trained, its workers' TensorFlow servers (which bind every
interface) listened in a network namespace of loopback only (tests/listeners.py). A worker that hangs (SIGSTOP) stops
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

import listeners
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
    out, tmp = tmp_path / "run", tmp_path / "tmp"
    tmp.mkdir()
    p = launch(out, "--speeds", "2,1", "--max-steps", "100000", env={"TMPDIR": str(tmp)})
    deadline = time.monotonic() + 600  # a hang guard; a launcher that ended early is seen at once
    while time.monotonic() < deadline and p.poll() is None and not has_step_rows(out):
        time.sleep(0.2)  # training has started
    assert p.poll() is None, p.communicate()[1][-3000:]
    run = listeners.tree(p.pid)  # while it trains: its servers are reachable from loopback only
    heard, reachable = listeners.listening(run), listeners.exposed(run)
    p.send_signal(signal.SIGTERM)
    stdout, stderr = p.communicate(timeout=600)  # a hang guard, not a deadline
    assert len([s for s in heard if s["interfaces"] == ["lo"]]) >= 2 and not reachable, heard
    assert "listen on every interface" not in stderr
    assert p.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "stopped by SIGTERM" in stderr and "Traceback" not in stderr and no_worker_left(out)
    # every worker saw the signal (TensorFlow's own SIGTERM handler was put back): a checkpoint at the stop
    said = (out / "tf-worker0.log").read_text()
    assert "SIGTERM received: stopped at step" in said and "after a checkpoint; continue with --resume" in said, \
        f"{said[-2000:]}\n--- worker 1:\n{(out / 'tf-worker1.log').read_text()[-2000:]}\n--- launcher:\n{stderr[-2000:]}"
    assert len(list((out / "checkpoints").glob("step-*/session.json"))) == 1
    assert list(tmp.iterdir()) == []  # the workers' TMPDIR (TensorFlow's autograph modules) went with the run


def test_sigterm_to_tensorflow_asp_stops_the_chief_and_every_server_which_listened_on_loopback_only(tmp_path):
    """``--mode asp``: a parameter server, two worker servers and the chief, forked into a network namespace of
    loopback only. SIGTERM to the launcher while the chief trains: the chief and every server stopped, one line,
    exit 143, nothing left (they outlived the launcher before, re-parented: issue 50)."""
    out, tmp = tmp_path / "run", tmp_path / "tmp"
    tmp.mkdir()
    p = launch(out, "--mode", "asp", "--workers", "2", "--max-time-s", "600", env={"TMPDIR": str(tmp)})
    deadline = time.monotonic() + 600  # a hang guard; a launcher that ended early is seen at once
    pushes = out / "metrics.jsonl"
    while time.monotonic() < deadline and p.poll() is None and '"push"' not in (pushes.read_text()
                                                                                if pushes.exists() else ""):
        time.sleep(0.2)  # the chief has pushed: every server is up
    assert p.poll() is None, p.communicate()[1][-3000:]
    run = listeners.tree(p.pid)
    heard, reachable = listeners.listening(run), listeners.exposed(run)
    p.send_signal(signal.SIGTERM)
    stdout, stderr = p.communicate(timeout=600)  # a hang guard, not a deadline
    assert p.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert len([s for s in heard if s["interfaces"] == ["lo"]]) == 4 and not reachable, heard  # ps, 2 workers, chief
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("omnilearn: interrupted by SIGTERM: the TensorFlow ASP chief and its servers were "
                           "stopped") and "Traceback" not in stderr, stderr[-3000:]
    for _ in range(100):  # the servers die with their fork server: a moment after the launcher exits
        if not [pid for pid in run if listeners.alive(pid)]:
            break
        time.sleep(0.1)
    assert not [pid for pid in run if listeners.alive(pid)] and list(tmp.iterdir()) == []  # nor a temporary file


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

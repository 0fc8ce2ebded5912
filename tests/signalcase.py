"""One case of the signal matrix: start an ``omnilearn`` command that starts processes, send its launcher a signal
once it trains, and check that nothing outlives it (tests/faults/test_signal_matrix.py for PyTorch,
tests/tf/test_tf_signal_matrix.py for TensorFlow, tests/tf/test_launch_signal_matrix.py for ``omnilearn launch``).

:func:`check` starts the command with a ``TMPDIR`` of the test's own, waits until it trains (or, for ``omnilearn
launch``, until every worker of its script started), sends the signal to the launcher, and asserts: the exit status
(128 + the signal, every worker stopped when asked, none SIGKILLed after the stop grace; killed by SIGKILL
itself otherwise), that no process of the run listened
where the machine's network reaches it (while it trained: tests/listeners.py), that every process of the run's
tree (read from ``/proc`` while it ran) is gone, and that the ``TMPDIR`` holds nothing (after SIGKILL, only the
launcher's own directories, which nobody is left to remove: its rendezvous or TensorFlow directory and, for
PyTorch, multiprocessing's ``pymp-*`` fork server directory marked as the launcher's; the next run sweeps them,
tests/unit/test_netns.py, and the sweep is run here). ``torchinductor_<user>`` is
torch's compile cache, kept across runs on purpose: not counted. Nothing is timed: the waits are hang guards.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import listeners
import pytest
from runfiles import has_step_rows

from omnilearn.experiments.launch import mptemp

GUARD_S = 600  # a hang guard, never a deadline

SLEEPY = """
import json, os, sys, time
from pathlib import Path
rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
Path(sys.argv[1], f"started-{rank}").write_text(str(os.getpid()))
while True:
    time.sleep(0.05)
"""


def pushed(out: Path) -> bool:
    metrics = out / "metrics.jsonl"
    return metrics.exists() and '"push"' in metrics.read_text()


def benching(out: Path) -> bool:
    return any(out.glob("*/steps/rank-*.jsonl"))


def bench_pushed(out: Path) -> bool:
    return any(pushed(arm) for arm in out.glob("*/"))


def started(out: Path) -> bool:
    return all((out.parent / f"started-{rank}").exists() for rank in (0, 1))


# command: (its arguments after ``omnilearn``, the condition that it trains)
COMMANDS = {
    "train-tensorflow": (["train", "--framework", "tensorflow", "--workers", "2", "--max-steps", "100000"],
                         has_step_rows),
    "train-tensorflow-asp": (["train", "--framework", "tensorflow", "--mode", "asp", "--workers", "2",
                              "--max-time-s", "3600"], pushed),
    "train-pytorch-asp": (["train", "--mode", "asp", "--workers", "2", "--max-time-s", "3600"], pushed),
    "launch": (["launch", "--workers", "2"], started),
    "bench-pytorch": (["bench", "--quick"], benching),
    "bench-pytorch-asp": (["bench", "--quick", "--mode", "asp"], bench_pushed),
    "bench-tensorflow-asp": (["bench", "--quick", "--mode", "asp", "--framework", "tensorflow"], bench_pushed),
}


def params(cases, marks=()):
    """``(command, signal)`` pairs as pytest parameters named ``<command>-<SIGNAL>``."""
    for command, signum in cases:
        yield pytest.param(command, signum, id=f"{command}-{signal.Signals(signum).name}", marks=list(marks))


def check(tmp_path: Path, command: str, signum: int) -> None:
    """Run ``command`` from :data:`COMMANDS`, signal its launcher once it trains, and assert nothing is left."""
    args, training = COMMANDS[command]
    out, tmp = tmp_path / "run", tmp_path / "tmp"
    tmp.mkdir()
    if command == "launch":
        script = tmp_path / "sleepy.py"
        script.write_text(SLEEPY)
        args = [*args, "--out", str(out), str(script), str(tmp_path)]
    else:
        args = [*args, "--out", str(out), "--no-plots"]
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONUNBUFFERED": "1"}
    run: list[int] = []
    with open(tmp_path / "stdout", "wb") as so, open(tmp_path / "stderr", "wb") as se:
        p = subprocess.Popen([sys.executable, "-m", "omnilearn", *args], stdout=so, stderr=se, env=env)
    try:
        deadline = time.monotonic() + GUARD_S
        while p.poll() is None and not training(out) and time.monotonic() < deadline:
            time.sleep(0.1)
        said = lambda: (tmp_path / "stderr").read_text(errors="replace")[-3000:]  # noqa: E731
        assert p.poll() is None, said()
        run = listeners.tree(p.pid)
        assert len(run) >= 3, run  # the launcher and its workers
        heard = listeners.listening(run)  # while it trains: loopback only (TensorFlow's in a namespace of lo)
        print(f"{command}: listening on", sorted({(s["address"], tuple(s["interfaces"])) for s in heard}))
        assert not listeners.exposed(run), heard
        p.send_signal(signum)
        code = p.wait(timeout=GUARD_S)
        for _ in range(int(GUARD_S / 0.1)):  # what dies with the launcher goes a moment after it
            if not [pid for pid in run if listeners.alive(pid)]:
                break
            time.sleep(0.1)
        assert not [pid for pid in run if listeners.alive(pid)], (run, said())
        left = sorted(n.name for n in tmp.iterdir() if not n.name.startswith("torchinductor_"))  # torch's cache
        if signum == signal.SIGKILL:
            assert code == -signal.SIGKILL
            ours = (f"omnilearn-tf-{p.pid}-", f"omnilearn-store-{p.pid}-")  # the next local run sweeps these
            assert all(name.startswith((*ours, mptemp.PREFIX)) for name in left), left
            mptemp.sweep(tmp)  # what the next local run's fork server does first
            assert [n for n in tmp.iterdir() if n.name.startswith(mptemp.PREFIX)] == [], left
        else:
            assert code == 128 + signum, (code, said())
            assert left == [], left
            assert "Traceback" not in said(), said()
            assert "SIGKILLed after the stop grace" not in said(), said()  # every worker stopped when asked
    finally:
        for pid in [pid for pid in run or [p.pid] if listeners.alive(pid)]:  # whatever a failed case left
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p.wait()

"""Fixtures for fault tests that drive a real ``omnilearn train`` process: start it, wait, find its processes.

``start_train(*flags)`` runs ``python -m omnilearn train --out RUN *flags`` with
``TMPDIR`` private to the test and stdout/stderr in files; the launcher and
every process it left behind are SIGKILLed at teardown, whatever the test did.
The ``wait_for`` fixture is ``wait_for(condition, timeout_s, what)``: it polls. Processes are identified by
pid and start time, so a recycled pid is never taken for a survivor, and a
zombie (dead, not reaped: PID 1 here does not reap) counts as dead.

Run: ``python -m pytest -q tests/faults``
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
from runfiles import has_step_rows

Proc = tuple[int, str]  # (pid, start time in clock ticks): one process, never a later one with the same pid


def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat from the state on (the name may hold spaces and parentheses); None if gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()


def proc(pid: int) -> Proc | None:
    fields = _stat(pid)
    return (pid, fields[19]) if fields else None


def alive(p: Proc) -> bool:
    fields = _stat(p[0])
    return fields is not None and fields[19] == p[1] and fields[0] != "Z"


def descendants(pid: int) -> set[Proc]:
    """Every live process below ``pid`` (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        fields = _stat(int(entry.name)) if entry.name.isdigit() else None
        if fields and fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if (p := proc(child)) is not None:
                found.add(p)
                todo.append(child)
    return found


def _wait_for(condition: Callable[[], object], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        time.sleep(0.05)


@dataclass
class TrainRun:
    proc: subprocess.Popen
    run_dir: Path
    tmpdir: Path  # the run's TMPDIR
    logs: Path
    seen: set[Proc] = field(default_factory=set)  # every process of the run looked at so far

    def stderr(self) -> str:
        return (self.logs / "stderr.txt").read_text()

    def worker_pids(self) -> dict[int, int]:
        """{rank: pid} from ``RUN_DIR/workers.pid`` (the launcher writes it once all workers started)."""
        path = self.run_dir / "workers.pid"
        text = path.read_text() if path.exists() else ""
        return {int(r): int(p) for r, p in (line.split() for line in text.splitlines() if line.strip())}

    def processes(self) -> set[Proc]:
        """The launcher and its live descendants now (also remembered for teardown)."""
        now = {p for p in [proc(self.proc.pid)] if p} | descendants(self.proc.pid)
        self.seen |= now
        return now

    @staticmethod
    def survivors(procs: set[Proc]) -> list[int]:
        """The pids among ``procs`` still alive (zombies are dead)."""
        return sorted(pid for pid, start in procs if alive((pid, start)))

    def training(self) -> bool:
        return has_step_rows(self.run_dir)


@pytest.fixture
def wait_for() -> Callable[[Callable[[], object], float, str], None]:
    """``wait_for(condition, timeout_s, what)``: poll until true, else fail saying ``what`` did not happen."""
    return _wait_for


@pytest.fixture
def start_train(tmp_path) -> Callable[..., TrainRun]:
    runs: list[TrainRun] = []

    def start(*flags: str) -> TrainRun:
        k = len(runs)
        run_dir, logs = tmp_path / f"run{k}", tmp_path / f"logs{k}"
        # Short, under /tmp: the launcher's fork server puts its socket in TMPDIR, and a path too long for a unix
        # socket (pytest-xdist's tmp_path is) would make it spawn every rank, which users do not get.
        tmpdir = Path(tempfile.mkdtemp(prefix="olrun-"))
        logs.mkdir()
        env = {**os.environ, "TMPDIR": str(tmpdir), "PYTHONUNBUFFERED": "1"}
        with open(logs / "stdout.txt", "wb") as out, open(logs / "stderr.txt", "wb") as err:
            p = subprocess.Popen([sys.executable, "-m", "omnilearn", "train", "--out", str(run_dir), *flags],
                                 stdout=out, stderr=err, env=env)
        runs.append(TrainRun(p, run_dir, tmpdir, logs))
        return runs[-1]

    yield start
    for run in runs:
        left = (run.processes() | run.seen) if run.proc.poll() is None else run.seen
        for pid, _ in (p for p in left if alive(p)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        run.proc.wait()
        shutil.rmtree(run.tmpdir, ignore_errors=True)

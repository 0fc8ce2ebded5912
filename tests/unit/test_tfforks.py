"""The TensorFlow launcher's fork server (``omnilearn.experiments.launch.tfforks``), with small scripts, no TensorFlow.

A forked worker is what ``python SCRIPT ARGS`` / ``python -m MODULE ARGS`` would be: its argv, environment, working
directory, ``sys.path[0]``, standard error in its log, standard output the console, nothing or a file, ``atexit`` run, exit
codes as ``Popen`` gives them (a signal: negative). A restart of a rank gets a new process and its own code; a
worker dies with the server.

Run: ``python -m pytest -q tests/unit/test_tfforks.py``
"""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import time

import pytest

from omnilearn.experiments.launch.tfforks import ForkServer

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fork server is Linux's")
HANG_GUARD_S = 120.0  # only a worker that outlives its server takes this long: never a measure of speed

SCRIPT = """
import atexit, os, sys
from pathlib import Path
out = Path(os.environ["OUT"])
atexit.register(lambda: (out / f"atexit-{os.environ['RANK']}").write_text("ran"))
(out / f"seen-{os.environ['RANK']}").write_text(repr((sys.argv, os.getcwd(), sys.path[0], os.getpid(), os.getsid(0))))
print(f"stdout of {os.environ['RANK']}", flush=True)
print(f"stderr of {os.environ['RANK']}", file=sys.stderr)
what = sys.argv[1]
if what == "raise":
    raise RuntimeError("bad data in batch 7")
if what == "kill":
    os.kill(os.getpid(), 9)
if what == "sleep":
    import time
    time.sleep(60)
sys.exit(int(what))
"""


def make_server(tmp_path) -> ForkServer:
    """Started now: it and its console workers write to the standard output as it is at this moment."""
    script = tmp_path / "scripts" / "job.py"
    script.parent.mkdir(exist_ok=True)
    script.write_text(textwrap.dedent(SCRIPT))
    server = ForkServer(dict(os.environ), tmp_path / "server.log", [sys.executable, str(script)], preload=("json",))
    server.script = script
    return server


@pytest.fixture
def server(tmp_path):
    with make_server(tmp_path) as s:
        yield s


def start(server, tmp_path, rank: int, what: str, console: bool = True):
    env = {**os.environ, "OUT": str(tmp_path), "RANK": str(rank)}
    return server.start(rank, [str(server.script), what], env, tmp_path / f"w{rank}.log", console)


def seen(tmp_path, rank: int) -> tuple:
    return eval((tmp_path / f"seen-{rank}").read_text())


def test_a_forked_script_is_what_python_script_would_be(tmp_path, capfd, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with make_server(tmp_path) as server:  # in the test: its standard output is capfd's
        zero, one = start(server, tmp_path, 0, "0"), start(server, tmp_path, 1, "3", console=False)
        assert zero.wait() == 0 and one.wait() == 3 and zero.pid != one.pid
    argv, cwd, path0, pid, sid = seen(tmp_path, 1)
    assert argv == [str(server.script), "3"] and cwd == str(tmp_path) and path0 == str(server.script.parent)
    assert sid == pid  # its own session, as the launcher's Popen(start_new_session=True) gave
    assert (tmp_path / "atexit-0").read_text() == (tmp_path / "atexit-1").read_text() == "ran"
    out = capfd.readouterr().out
    assert "stdout of 0" in out and "stdout of 1" not in out  # worker 0 speaks
    assert (tmp_path / "w1.log").read_text().strip() == "stderr of 1"


def test_a_workers_standard_output_can_go_to_a_file(server, tmp_path, capfd):
    out = tmp_path / "w0.out"
    out.write_text("before\n")
    assert start(server, tmp_path, 0, "0", console=out).wait() == 0
    assert out.read_text() == "before\nstdout of 0\n"  # appended, as the log is
    assert "stdout of 0" not in capfd.readouterr().out


def test_exit_codes_are_popens_and_a_traceback_goes_to_the_log(server, tmp_path):
    failing, killed = start(server, tmp_path, 0, "raise"), start(server, tmp_path, 1, "kill")
    assert failing.wait() == 1 and killed.wait() == -signal.SIGKILL
    log = (tmp_path / "w0.log").read_text()
    assert "Traceback" in log and log.strip().splitlines()[-1] == "RuntimeError: bad data in batch 7"


def test_a_signal_reaches_the_worker_and_a_restarted_rank_is_a_new_process(server, tmp_path):
    first = start(server, tmp_path, 0, "sleep")
    assert first.poll() is None
    first.send_signal(signal.SIGTERM)
    assert first.wait() == -signal.SIGTERM
    again = start(server, tmp_path, 0, "0")  # the same rank, as a restart starts it
    assert again.pid != first.pid and again.wait() == 0 and first.returncode == -signal.SIGTERM


def test_a_worker_dies_with_its_server(server, tmp_path):
    worker = start(server, tmp_path, 0, "sleep")
    pid = worker.pid
    server.proc.kill()
    assert worker.wait() == -signal.SIGKILL
    guard = time.monotonic() + HANG_GUARD_S
    while os.path.exists(f"/proc/{pid}") and "Z" not in _state(pid) and time.monotonic() < guard:
        time.sleep(0.05)  # the parent-death signal ends it soon; the guard only ends a test that would hang
    assert not os.path.exists(f"/proc/{pid}") or "Z" in _state(pid)  # gone, or a zombie waiting for init


def _state(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def test_a_server_that_cannot_import_fails_worker_0_with_its_error(tmp_path):
    log = tmp_path / "w0.log"
    with ForkServer(dict(os.environ), log, [sys.executable, "x.py"], preload=("no_such_module_here",)) as server:
        worker = server.start(0, ["x.py"], dict(os.environ), log, True)
        assert worker.wait() == 1
    assert "ModuleNotFoundError: No module named 'no_such_module_here'" in log.read_text()


class _Ended:
    """A worker that ended with ``code`` (``None``: still running, until ``ends_with`` after ``after`` polls)."""

    def __init__(self, code: int | None, ends_with: int | None = None, after: int = 0) -> None:
        self.returncode, self._then, self._polls = code, ends_with, after

    def poll(self) -> int | None:
        if self.returncode is None and self._then is not None:
            self._polls -= 1
            if self._polls <= 0:
                self.returncode = self._then
        return self.returncode


def test_the_launcher_blames_a_worker_killed_by_a_signal_over_the_peers_it_took_down():
    from omnilearn.experiments.launch.tfworkers import first_failed

    # seen together: worker 0's error (its collective with the dead worker failed) is a consequence
    assert first_failed([_Ended(1), _Ended(-signal.SIGKILL), _Ended(1)]) == 1
    # worker 0's error seen first; worker 2's death by SIGKILL is reaped a few polls later, within the settle time
    assert first_failed([_Ended(1), _Ended(None), _Ended(None, ends_with=-signal.SIGKILL, after=3)]) == 2
    # no death by a signal: the lowest rank that failed
    assert first_failed([_Ended(0), _Ended(2), _Ended(1)]) == 1


def test_a_stop_asked_for_while_the_server_imports_ends_it_at_once(tmp_path):
    """An import that hangs (a wedged file system, a lock): the launcher, told to stop, kills the server rather
    than wait for a pid that never comes."""
    (tmp_path / "wedged.py").write_text("import time\ntime.sleep(120)\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    asks = []
    with ForkServer(env, tmp_path / "w0.log", [sys.executable, "x.py"], preload=("wedged",)) as server:
        worker = server.start(0, ["x.py"], env, tmp_path / "w0.log", True,
                              give_up=lambda: asks.append(1) or len(asks) > 5)  # asked after five polls
        assert worker.wait() == -signal.SIGKILL
    assert server.proc.returncode == -signal.SIGKILL  # killed, not waited for through its two-minute import

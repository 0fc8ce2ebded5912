"""``ol.should_stop`` in a user's own script: stop signals under torchrun, and how the handlers are installed.

- SIGTERM to a ``torchrun --nproc-per-node 2`` job running a user script
  (``api_stop_script.py``: the public API, the stop path of docs/failures.md):
  torchrun forwards it, every rank sees ``should_stop`` after the same step,
  the final checkpoint of that step is written (and resumes, here on 1
  worker), each rank exits 143 and torchrun itself exits 1 (torch's launcher
  re-raises the signal it got). The job is watched through the step files the
  script writes, never timed.
- ``omnilearn.setup()`` installs the handlers (``handle_signals=True``):
  SIGTERM in a lone process, SIGINT left as KeyboardInterrupt there;
  ``handle_signals=False`` installs nothing; a bad value is one line.
- A user's own handler is chained, not replaced (it still runs, after the
  flag is set) and put back by :func:`omnilearn.stopping.restore_handlers`;
  SIG_IGN stays ignored; off the main thread nothing is installed and the
  note says so; a second signal within a second is the same stop, a later
  one exits at once (scripted clock).

Run: ``python -m pytest -q tests/faults/test_api_stops.py`` (about 25 s on 2 cores: torchrun starting 2 workers).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import omnilearn
from omnilearn import stopping

pytestmark = pytest.mark.dist

SCRIPT = Path(__file__).with_name("api_stop_script.py")
START_S = 120.0  # a loaded 2-core machine may take long to import torch in every worker
END_S = 60.0  # torchrun SIGKILLs workers 30 s after forwarding the signal: a stop that works ends well before
SIGNAL_AT_STEP = 5


@pytest.fixture
def handlers():
    """Whatever a test installs, SIGTERM/SIGINT and the stop flag are as before afterwards."""
    saved = {s: signal.getsignal(s) for s in stopping.STOP_SIGNALS}
    stopping.clear()
    yield
    stopping.restore_handlers()
    for s, handler in saved.items():
        signal.signal(s, handler)
    stopping.clear()


@pytest.fixture
def clock(monkeypatch) -> list[float]:
    """The stop module's monotonic clock, scripted: ``clock[0] += s`` moves it (signals within a second are one)."""
    now = [100.0]

    class Time:
        @staticmethod
        def monotonic() -> float:
            return now[0]

    monkeypatch.setattr(stopping, "time", Time)
    return now


def _step(path: Path) -> int:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return -1


def _torchrun(out: Path, logs: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TMPDIR": str(out)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT),
           str(out)]
    with open(logs, "wb") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def test_sigterm_to_torchrun_stops_every_rank_at_one_step_after_a_final_checkpoint(tmp_path, wait_for):
    out, logs = tmp_path / "out", tmp_path / "torchrun.log"
    out.mkdir()
    job = _torchrun(out, logs)
    try:
        wait_for(lambda: _step(out / "rank0.step") >= SIGNAL_AT_STEP or job.poll() is not None, START_S,
                 f"rank 0 reaches step {SIGNAL_AT_STEP}")
        assert job.poll() is None, logs.read_text()[-3000:]
        seen = _step(out / "rank0.step")
        job.send_signal(signal.SIGTERM)  # to torchrun alone: it forwards SIGTERM to every worker
        code = job.wait(timeout=END_S)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)  # its own session: torchrun and its workers
            job.wait()
    said = logs.read_text()
    stopped = [out / f"rank{r}.stopped" for r in (0, 1)]
    assert all(p.exists() for p in stopped), f"a rank died without its stop path:\n{said[-3000:]}"
    ends = [json.loads(p.read_text()) for p in stopped]
    assert ends[0]["step"] == ends[1]["step"] >= seen, (ends, seen)
    assert [e["exit"] for e in ends] == [143, 143]
    assert [_step(out / f"rank{r}.step") for r in (0, 1)] == [ends[0]["step"]] * 2  # nobody stepped on
    assert code == 1, said[-3000:]  # torchrun re-raises the SIGTERM it got as an error, whatever the workers did
    assert "SIGTERM received: stopping after the next control interval end" in said
    ol = omnilearn.setup(global_batch=8, device="cpu", handle_signals=False)  # the final checkpoint resumes
    assert ol.load_checkpoint(out / "ckpt") and ol.next_step == ends[0]["step"]


def test_setup_handles_sigterm_in_a_lone_process_and_leaves_ctrl_c_alone(handlers):
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a foreground shell (a background job ignores it)
    omnilearn.setup(global_batch=8, device="cpu", handle_signals=False)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    ol = omnilearn.setup(global_batch=8, device="cpu")
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # one process: Ctrl-C stays KeyboardInterrupt
    signal.raise_signal(signal.SIGTERM)  # the default would end pytest here
    assert stopping.stop_requested() and stopping.exit_code() == 143
    ol.release()
    stopping.restore_handlers()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_bad_handle_signals_is_one_line():
    with pytest.raises(omnilearn.ConfigError) as e:
        omnilearn.setup(device="cpu", handle_signals="yes")
    assert str(e.value) == ("handle_signals='yes' must be True or False (False: SIGTERM/SIGINT keep their own "
                            "handlers and never set should_stop)")


def test_a_users_own_handler_is_chained_and_put_back(handlers, clock):
    calls = []

    def mine(signum, frame):
        calls.append((signum, stopping.stop_requested()))

    signal.signal(signal.SIGTERM, mine)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    assert stopping.install_handlers() == []
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # started to ignore it: stays ignored
    signal.raise_signal(signal.SIGTERM)
    assert calls == [(signal.SIGTERM, True)]  # the user's handler ran, after the flag was set
    assert stopping.stop_requested() and stopping.signal_number() == signal.SIGTERM
    stopping.install_handlers()  # again (setup() twice): still one chain, not two
    signal.raise_signal(signal.SIGTERM)  # within a second: the same stop, delivered twice
    assert len(calls) == 2
    stopping.restore_handlers()
    assert signal.getsignal(signal.SIGTERM) is mine


def test_a_second_later_signal_exits_at_once_and_a_duplicate_does_not(handlers, clock):
    signal.signal(signal.SIGINT, signal.default_int_handler)
    stopping.install_handlers((signal.SIGINT,))
    signal.raise_signal(signal.SIGINT)  # no KeyboardInterrupt: a stop request
    clock[0] += stopping.DUPLICATE_S / 2
    signal.raise_signal(signal.SIGINT)  # the same stop (the terminal's and torchrun's copy)
    assert stopping.stop_requested() and stopping.exit_code() == 130
    clock[0] += stopping.DUPLICATE_S
    with pytest.raises(SystemExit) as e:
        signal.raise_signal(signal.SIGINT)
    assert e.value.code == 130


def test_off_the_main_thread_nothing_is_installed_and_the_note_says_so(handlers):
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    notes: list[list[str]] = []
    worker = threading.Thread(target=lambda: notes.append(stopping.install_handlers()))
    worker.start()
    worker.join()
    assert len(notes[0]) == 1 and notes[0][0].startswith("SIGTERM/SIGINT not handled: Python installs signal "
                                                         "handlers from the main thread only")
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

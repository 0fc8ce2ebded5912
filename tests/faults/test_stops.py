"""Clean stops and the right rank named, with a real ``omnilearn train`` (2 local workers, gloo on CPU).

- SIGINT or SIGTERM to the launcher while it trains, or SIGTERM while its
  workers still start: it exits non-zero with one line (while training: no
  worker SIGKILLed, they stopped at their safe point), every process of the
  run is gone and its ``omnilearn-store-*`` temp dir removed.
- SIGKILL to the launcher: the workers die with it (parent-death signal).
- SIGSTOP to one worker (``heartbeat_s = 3``): the run fails naming that
  rank (the heartbeat watchdog's verdict), not a peer after the 300 s
  collective timeout; SIGKILL to one worker: the error names that rank.
  Nothing is timed: :data:`HANG_GUARD_S` only ends a test whose run hangs.
- The watchdog beats from its thread while the group runs collectives, on a
  FileStore and on a TCPStore (2 processes), and raises no false alarm.
- In-process: the watchdog names a silent peer and not a finished one, ends
  a rank whose store fails; a failed error-log write never raises; the
  launcher's blame order.

Run: ``python -m pytest -q tests/faults/test_stops.py`` (about a minute on 2 cores).
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from ranks import start_ranks
import torch
import torch.distributed as dist

from omnilearn.distributed import group
from omnilearn.distributed import watchdog as wd
from omnilearn.distributed.watchdog import ErrorLog, read_error_logs
from omnilearn.experiments.launch.supervise import Exit, blame

pytestmark = pytest.mark.dist

HANG_GUARD_S = 120.0  # only a run that hangs takes this long: never a measure of speed
START_S = 120.0  # a loaded 2-core machine may take long to import torch in every worker
LONG_RUN = ("--workers", "2", "--dataset", "synthetic", "--speeds", "1,1", "--global-batch", "64", "--epochs", "1000",
            "--max-steps", "1000000", "--control-interval", "5", "--no-plots")


def _heartbeat_config(tmp_path: Path, heartbeat_s: float) -> tuple[str, str]:
    path = tmp_path / "heartbeat.toml"
    path.write_text(f"[train]\nheartbeat_s = {heartbeat_s}\n")
    return "--config", str(path)


def _training(start_train, wait_for, *flags: str):
    run = start_train(*LONG_RUN, *flags)
    wait_for(lambda: run.training() or run.proc.poll() is not None, START_S, "the run trains")
    assert run.proc.poll() is None, run.stderr()
    assert len(run.worker_pids()) == 2
    return run


def _ends(run) -> int:
    try:
        return run.proc.wait(timeout=HANG_GUARD_S)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the launcher hangs: still running {HANG_GUARD_S:g} s after the signal") from None


def _last_line(run) -> str:
    lines = run.stderr().strip().splitlines()
    return lines[-1] if lines else ""


def _all_gone(run, procs) -> None:
    """Every process of the run ends (the kernel delivers parent-death signals soon; the guard is for a hang)."""
    since = time.monotonic()
    while run.survivors(procs) and time.monotonic() < since + HANG_GUARD_S:
        time.sleep(0.05)
    assert not run.survivors(procs), f"still alive: pids {run.survivors(procs)}"


# ------------------------------------------------------------------ signals to the launcher
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_to_the_launcher_stops_every_process_and_removes_the_store(start_train, wait_for, signum):
    run = _training(start_train, wait_for)
    procs = run.processes()
    assert set(run.worker_pids().values()) <= {pid for pid, _ in procs}
    assert list(run.tmpdir.glob("omnilearn-store-*"))
    run.proc.send_signal(signum)
    code = _ends(run)
    assert code in (1, 128 + signum)  # 1 until the CLI maps Interrupted to 128 + signal
    assert _last_line(run).startswith("omnilearn: ") and \
        f"interrupted by {signum.name}: every worker was asked to stop (SIGTERM)" in _last_line(run), run.stderr()
    assert "SIGKILL" not in _last_line(run)  # they stopped at their next interval end, after a checkpoint
    assert "Traceback" not in run.stderr()
    _all_gone(run, procs)
    assert not list(run.tmpdir.glob("omnilearn-store-*"))
    assert not (run.run_dir / "workers.pid").exists()


def test_sigterm_while_the_workers_start_leaves_no_orphan(start_train, wait_for):
    run = start_train(*LONG_RUN)
    wait_for(lambda: len(run.worker_pids()) == 2 or run.proc.poll() is not None, START_S, "the workers start")
    procs = run.processes()
    run.proc.send_signal(signal.SIGTERM)
    assert _ends(run) in (1, 128 + signal.SIGTERM)
    assert _last_line(run).startswith("omnilearn: ") and "interrupted by SIGTERM" in _last_line(run), run.stderr()
    _all_gone(run, procs)
    assert not list(run.tmpdir.glob("omnilearn-store-*"))


def test_sigkill_to_the_launcher_takes_the_workers_with_it(start_train, wait_for):
    run = _training(start_train, wait_for)
    procs = run.processes()
    workers = {p for p in procs if p[0] in run.worker_pids().values()}
    run.proc.send_signal(signal.SIGKILL)
    assert run.proc.wait(timeout=HANG_GUARD_S) == -signal.SIGKILL
    _all_gone(run, workers)


# ------------------------------------------------------------------ a worker stops answering or dies
def test_a_stopped_worker_is_named_within_seconds(start_train, wait_for, tmp_path):
    run = _training(start_train, wait_for, *_heartbeat_config(tmp_path, 3))
    procs = run.processes()
    os.kill(run.worker_pids()[1], signal.SIGSTOP)
    assert _ends(run) == 1
    assert _last_line(run).startswith("omnilearn: error: worker rank 1 stopped answering: no heartbeat for 3 s"), \
        run.stderr()
    assert "Traceback" not in run.stderr()
    _all_gone(run, procs)  # the stopped worker too


def test_a_killed_worker_is_named(start_train, wait_for):
    run = _training(start_train, wait_for)
    procs = run.processes()
    os.kill(run.worker_pids()[0], signal.SIGKILL)
    assert _ends(run) == 1
    assert _last_line(run) == "omnilearn: error: worker rank 0 died (killed by SIGKILL)", run.stderr()
    assert "Traceback" not in run.stderr()
    _all_gone(run, procs)


# ------------------------------------------------------------------ in-process: watchdog, error logs, blame
def test_the_watchdog_names_a_silent_peer_but_not_a_finished_one():
    store, verdicts = dist.HashStore(), []
    silent = wd.Watchdog(store, 0, 3, 0.6, verdicts.append).start()  # watches ranks 1 and 2
    store.add(silent.key(1), 1)  # rank 1 beats once, then nothing
    store.add(silent.key(2), 1 + wd.DONE)  # rank 2 beat and left
    assert silent.wait(5)  # the thread ends with its verdict
    assert len(verdicts) == 1 and wd.hung_rank(verdicts[0]) == 1, verdicts
    assert verdicts[0] == "worker rank 1 stopped answering: no heartbeat for 0.6 s (hung, stopped or dead; " \
                          "--heartbeat-s 0.6)"


def test_the_watchdog_keeps_quiet_while_peers_beat_and_says_goodbye():
    store, verdicts = dist.HashStore(), []
    dogs = [wd.Watchdog(store, r, 2, 0.6, verdicts.append, namespace="test") for r in range(2)]
    for d in dogs:
        d.start()
    time.sleep(1.5)  # more than two heartbeats
    for d in dogs:
        d.stop()
    assert verdicts == []
    assert all(store.add(dogs[0].key(r), 0) >= wd.DONE for r in range(2))


def test_a_failing_store_ends_the_rank_with_one_line():
    class GoneStore(dist.Store):
        def add(self, key, value):
            raise RuntimeError("Connection refused\nframe #0: ...")

    verdicts = []
    dog = wd.Watchdog(GoneStore(), 1, 2, 0.6, verdicts.append).start()
    assert dog.wait(5)
    assert len(verdicts) == 1 and verdicts[0].startswith("rank 1 lost the rendezvous store (Connection refused)")
    assert "\n" not in verdicts[0] and wd.hung_rank(verdicts[0]) is None


def test_an_error_log_that_cannot_be_written_is_reported_not_raised(tmp_path, monkeypatch):
    def disk_full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", disk_full)
    assert wd.write_error_log(tmp_path, 2, "ValueError: boom", "Traceback ...") is False
    assert list(tmp_path.iterdir()) == []  # no half-written file left
    monkeypatch.undo()
    (tmp_path / "error-rank1.log").write_text("")  # what a full disk leaves behind without the temp + rename
    (tmp_path / "error-rank0.log").write_text("not-a-time oops\n")
    assert wd.write_error_log(tmp_path, 2, "ValueError: boom", "Traceback ...") is True
    logs = read_error_logs(tmp_path)
    assert [(log.rank, log.cause) for log in sorted(logs, key=lambda log: log.rank)] == [
        (0, "not-a-time oops"), (1, "(empty error log)"), (2, "ValueError: boom")]


def test_blame_prefers_a_hung_verdict_then_a_dead_rank_then_the_earliest_error(tmp_path):
    t = 1000.0
    peer_error = ErrorLog(t + 0.01, 0, "RuntimeError: Connection reset by peer")
    dead = Exit(1, -signal.SIGKILL, t + 0.1, ours=False)
    assert blame([dead], [peer_error], tmp_path) == "worker rank 1 died (killed by SIGKILL)"
    verdict = ErrorLog(t + 3, 2, wd.hung_message(1, 3))
    assert blame([dead], [peer_error, verdict], tmp_path).startswith("worker rank 1 stopped answering")
    earlier = ErrorLog(t - 5, 2, "ValueError: bad batch")  # a real error well before the death: the cause
    assert blame([dead], [earlier, peer_error], tmp_path).startswith("worker rank 2 failed: ValueError: bad batch")
    killed_by_us = Exit(1, -signal.SIGKILL, t + 0.1, ours=True)
    assert blame([killed_by_us], [peer_error], tmp_path).startswith("worker rank 0 failed: RuntimeError")
    assert blame([Exit(3, 7, t, ours=False)], [], tmp_path) == \
        "worker rank 3 exited with code 7 and left no error log; see the messages above"


# ------------------------------------------------------------------ the watchdog beside collectives
def _beside_collectives(rank: int, init_method: str, log_dir: str) -> None:
    ctx = group.init(rank, 2, rank, 2, "cpu", 60, init_method)
    dog = wd.start_watchdog(ctx, 0.6, Path(log_dir))  # a false verdict would end this process with code 1
    x, go = torch.ones(10_000), torch.ones(1)
    target = 4 * wd.BEATS_PER_HEARTBEAT  # four heartbeats' worth of beats from each thread, however long they take

    def beats() -> list[int]:
        return [dog.store.add(dog.key(r), 0) for r in range(2)]

    while go.item():
        dist.all_reduce(x)
        go.fill_(float(min(beats()) < target))
        dist.all_reduce(go, op=dist.ReduceOp.MAX)  # the same number of collectives on both ranks
    dist.barrier()
    dog.stop()
    dist.barrier()
    assert all(b - wd.DONE >= target for b in beats())
    group.destroy()


@pytest.mark.parametrize("store", ["file", "tcp"])
def test_the_watchdog_beats_beside_collectives(tmp_path, store):
    if store == "file":
        init = f"file://{tmp_path}/store"
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    start_ranks(_beside_collectives, (init, str(tmp_path)), 2)
    assert list(tmp_path.glob("error-rank*.log")) == []

"""ASP survives failures, with real processes: a SIGKILLed worker is dropped, a killed server resumes.

- A worker SIGKILLs itself mid-run (``OMNILEARN_FAULT_KILL_AT``, :mod:`omnilearn.asp.faults`),
  ``before`` sending its push or ``after`` it: the server sees its connection fail at once
  (not after ``--heartbeat-s``). It drops it, naming it (stderr and a ``drop`` event), deals
  its samples again, and the run completes with the others; every sample is applied exactly
  once per epoch (the server's coverage ledger, cross-checked against the push events).
- A worker SIGSTOPs itself (``...:STOP``) before its push, between announcing its request and
  sending it (``sending``), or after it (``after``, the reply never taken): only that worker
  is dropped after ``--heartbeat-s``, the others finish (trial 6.3: a server waiting on such
  an exchange dropped every worker, or hung for ``--timeout-s``).
- The server SIGKILLs itself mid-run; all processes are relaunched with ``resume=True``
  and the run continues at the checkpoint's version (a ``resume`` event), completes, and
  still applies every sample once per epoch across the restart.
- SIGTERM to every process (what the launcher sends on Ctrl-C): the server saves a
  checkpoint at once, tells the workers to stop (they exit 0) and raises ``Stopped``.

The processes of the tests above are started here as the launcher starts them (one
process group, the harness's ``train_asp`` per rank). The tests at the end go through
``omnilearn train --mode asp`` itself (:mod:`omnilearn.experiments.launch.supervise`): a killed
worker leaves the run going (exit 0, one warning line naming it); a killed server fails the
attempt, naming ``the parameter server (rank 0)``, and ``--max-restarts 1`` resumes it; a
hung (SIGSTOPped) server is named by its workers' watchdogs and every process ends.
In-process: who watches whom in ASP, and the launcher's blame naming the server.

Run: ``python -m pytest -q tests/faults/test_asp_faults.py`` (about three minutes on 2 cores).
"""

from __future__ import annotations

import json
import os
import signal
import time
import traceback
from pathlib import Path

import pytest
from ranks import start_ranks
import torch.distributed as dist

from omnilearn import stopping
from omnilearn.asp.faults import ENV, KillPoint, kill_point
from omnilearn.checkpoint import CheckpointStore
from omnilearn.distributed import group
from omnilearn.distributed import watchdog as wd
from omnilearn.experiments.train import workload
from omnilearn.experiments.train.asp import train_asp
from omnilearn.experiments.cli import main
from omnilearn.experiments.config import TrainConfig
from omnilearn.experiments.launch.supervise import Exit, blame
from omnilearn.observe.metrics import read_metrics

pytestmark = pytest.mark.dist

TRAIN_LEN = 10_000  # MNIST-1D's training split
# Epochs of 10 steps of B = 1000 (333 samples per push with 3 workers), about half a second each on an idle
# 2-core host. Runs are counted in epochs, never in training time: a time budget left a busy host (a CPU hog
# beside the suite) fewer than the 3 epochs the ledger check needs, or no epoch after a frozen worker's drop.
# A frozen worker is dropped 2 s (the heartbeat) of wall time after it froze at its 5th push: 3-5 epochs in on an
# idle 2-core host, 1-2 on a busy one. STOP_EPOCHS leaves whole epochs after the drop on a host up to ~3x faster.
STOP_EPOCHS = 15
RUN = dict(mode="asp", global_batch=1000, epochs=STOP_EPOCHS, control_interval=3, lr_schedule="constant",
           heartbeat_s=2.0, timeout_s=60.0, quiet=True)
HANG_GUARD_S = 600.0  # these runs take seconds to a minute: only a hung one is stopped by it


def _rank(rank: int, world: int, store: str, out: str, flags: dict) -> None:
    """One process of an ASP run: join the group as the launcher does, then run the harness's ``train_asp``."""
    cfg = TrainConfig(**flags)
    stopping.install_handlers()  # as the launcher's ranks: SIGTERM asks for a stop at the next safe point
    try:
        ctx = group.init(rank, world, rank, world, "cpu", cfg.timeout_s, f"file://{store}", "gloo")
        train_asp(cfg, ctx, Path(out) if rank == 0 else None)
    except BaseException as e:  # noqa: BLE001 - the test reads how each rank ended
        Path(out, f"rank{rank}.err").write_text(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        raise SystemExit(1) from None


def launch(out: Path, deadline_s: float = HANG_GUARD_S, signal_after_pushes: int | None = None,
           frozen: tuple[int, ...] = (), **flags) -> list[int | None]:
    """Run every rank of one ASP run to its end; their exit codes (negative: killed by that signal).

    ``signal_after_pushes``: SIGTERM every rank once ``metrics.jsonl`` holds that many pushes.
    ``frozen``: ranks that stop themselves (SIGSTOP): woken (SIGCONT) once the others ended, then waited for.
    ``deadline_s`` is a hang guard, not a limit a slow host should meet.
    """
    cfg = TrainConfig(**{**RUN, **flags})
    world = cfg.workers + 1
    workload.load_data(cfg)  # generated here once (the session's cache), not by every process at once
    out.mkdir(parents=True, exist_ok=True)
    store = out.parent / f"store-{out.name}-{time.monotonic_ns()}"
    ctx = start_ranks(_rank, (world, str(store), str(out), {**RUN, **flags}), world, join=False)
    deadline = time.monotonic() + deadline_s
    while signal_after_pushes is not None and time.monotonic() < deadline:
        if (out / "metrics.jsonl").exists() and \
                (out / "metrics.jsonl").read_text().count('"event":"push"') >= signal_after_pushes:
            for p in ctx.processes:
                os.kill(p.pid, signal.SIGTERM)
            break
        time.sleep(0.05)
    for rank, p in enumerate(ctx.processes):
        if rank not in frozen:
            p.join(max(0.1, deadline - time.monotonic()))
    for rank in frozen:
        os.kill(ctx.processes[rank].pid, signal.SIGCONT)
        ctx.processes[rank].join(max(0.1, deadline - time.monotonic()))
    codes = [p.exitcode for p in ctx.processes]
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
            p.join()
    return codes


def errors(out: Path) -> dict[str, str]:
    return {f.name: f.read_text().splitlines()[0] for f in out.glob("rank*.err")}


def check_every_sample_once_per_epoch(out: Path, summary: dict) -> None:
    """The server's ledger: no repeat, every epoch but the last two whole (at the end some samples are in flight,
    and the last epoch is cut); its counts match the (replayed) push events."""
    assert summary["repeated_samples"] == 0
    per_epoch = summary["samples_per_epoch"]
    assert summary["complete_epochs"] == [e for e, k in enumerate(per_epoch) if k == TRAIN_LEN]
    assert len(per_epoch) >= 3 and set(summary["complete_epochs"]) >= set(range(len(per_epoch) - 2)), per_epoch
    assert all(k <= TRAIN_LEN for k in per_epoch)
    pushed = [0] * len(per_epoch)
    for p in read_metrics(out, "push"):
        pushed[p["data_epoch"]] += p["batch"]
    assert pushed == per_epoch


@pytest.mark.parametrize("phase", ["before", "after"])
def test_a_killed_worker_is_dropped_at_once_and_the_others_finish_using_every_sample_once(tmp_path, monkeypatch,
                                                                                        capfd, phase):
    out = tmp_path / "run"
    monkeypatch.setenv(ENV, f"2:5:{phase}")  # worker rank 2 dies at its 5th push, in epoch 0
    start = time.monotonic()
    # --heartbeat-s 30 outlasts the run (4 epochs, 2 s on an idle host): the death is seen on its connection (its
    # listener's wait, or the reply to it, fails at once), never by its silence; then the others push on without
    # it. A death seen at once needs no long run: 4 epochs is one in progress and three after, at any speed.
    codes = launch(out, workers=3, speeds="1,1,1", heartbeat_s=30.0, epochs=4)
    elapsed = time.monotonic() - start
    assert codes == [0, 0, -9, 0], (codes, errors(out))
    summary = json.loads((out / "summary.json").read_text())
    (drop,) = read_metrics(out, "drop")
    assert drop["rank"] == 1 and summary["dropped"] == [{"rank": 1, "version": drop["version"],
                                                         "reason": drop["reason"]}]
    assert drop["reason"].startswith("its connection failed: worker rank 2 ") and drop["redealt"] > 0, drop
    if phase == "after":  # its 5th push was sent; the server's next exchange with it failed
        # Usually the push is applied and the reply with the next batch fails; if the dead process's reset
        # reaches the server before it read the gradients, that read fails and the push's batch is dealt again.
        assert sum(p["rank"] == 1 for p in read_metrics(out, "push")) in (4, 5)
    assert drop["live"] == [0, 2] and sum(drop["batches"]) == 1000  # its share went to the others
    assert "warning: dropped worker rank 2 at version" in capfd.readouterr().err
    pushes = read_metrics(out, "push")
    assert [p["version"] for p in pushes] == list(range(1, len(pushes) + 1)) == list(range(1, summary["updates"] + 1))
    assert all(p["rank"] != 1 for p in pushes if p["version"] > drop["version"])
    assert any(p["version"] > drop["version"] for p in pushes)  # dropped while training, not at the end
    assert drop["data_epoch"] in summary["complete_epochs"]  # what it held was dealt again and applied
    check_every_sample_once_per_epoch(out, summary)
    print(f"{phase}: {elapsed:.1f} s, drop at version {drop['version']}, {summary['updates']} updates, "
          f"samples per epoch {summary['samples_per_epoch']}")


@pytest.mark.parametrize("phase", ["before", "sending", "after"])
def test_a_stopped_worker_is_dropped_and_the_others_finish_using_every_sample_once(tmp_path, monkeypatch, phase):
    """A frozen worker (SIGSTOP) is only silent: dropped after --heartbeat-s, wherever its cycle froze.

    ``sending``: its header was announced, and its bytes (if the server was not waiting for them yet: gloo
    sends once the receiver is ready) or its gradients never come; ``after``: its push arrived and it never
    takes the reply. A server that waits on such an exchange with one connection for all workers let every
    other worker's deadline lapse (all dropped: ``WorkersGone``), or hung for --timeout-s.
    """
    out = tmp_path / "run"
    monkeypatch.setenv(ENV, f"2:5:{phase}:STOP")  # worker rank 2 freezes at its 5th push, in epoch 0
    start = time.monotonic()
    codes = launch(out, frozen=(2,), workers=3, speeds="1,1,1", timeout_s=8.0)
    elapsed = time.monotonic() - start
    assert codes == [0, 0, 1, 0], (codes, errors(out))
    # Woken at the end, the dropped worker ends with one line naming the server: its connection closed, or
    # (when its gloo thread had not yet seen the server's end as it posted) its wait ran out (--timeout-s 8).
    woken = errors(out)["rank2.err"]
    assert woken.startswith("PeerTimeout: the server (rank 0) ") and \
        ("the connection closed" in woken or "within 8 s" in woken), woken
    summary = json.loads((out / "summary.json").read_text())
    (drop,) = read_metrics(out, "drop")
    assert drop["rank"] == 1 and drop["live"] == [0, 2] and sum(drop["batches"]) == 1000, drop
    # "sending": its header's bytes went out only if the server already waited for them (it usually does)
    silent = {"before": ("sent nothing for",), "sending": ("sent a header but no gradients for", "sent nothing for"),
              "after": ("took no reply for",)}[phase]
    assert drop["reason"].startswith(silent) and drop["reason"].endswith(" s (--heartbeat-s 2)"), drop["reason"]
    pushes = read_metrics(out, "push")
    assert sum(p["rank"] == 1 for p in pushes) == (5 if phase == "after" else 4)  # "after": its 5th was applied
    # While the server waited for it, the others pushed: nobody waited on it (a server blocked in the
    # exchange with it applied nothing until it gave up on it), and they went on after the drop.
    assert max(p["version"] for p in pushes if p["rank"] == 1) < drop["version"] < pushes[-1]["version"]
    assert drop["data_epoch"] in summary["complete_epochs"]  # what it held was dealt again and applied
    check_every_sample_once_per_epoch(out, summary)
    print(f"{phase}: {elapsed:.1f} s, drop at version {drop['version']} ({drop['reason']}), "
          f"{summary['updates']} updates")


def test_a_killed_server_resumes_from_its_checkpoint_and_completes(tmp_path, monkeypatch):
    out = tmp_path / "run"
    flags = dict(workers=2, speeds="1,1", checkpoint_every=4, keep_checkpoints=2, epochs=3,
                 heartbeat_s=30.0)  # 60 pushes, nobody silent
    monkeypatch.setenv(ENV, "0:30")  # the server dies once it reached version 30 (checkpoints every 8)
    codes = launch(out, **flags)
    assert codes[0] == -9 and all(c != 0 for c in codes[1:]), codes  # the workers lose the server
    store = CheckpointStore(out / "checkpoints")
    step = store.steps()[-1]
    version = store.manifest(step)["meta"]["version"]
    assert 0 < version <= 30 and step == version // 2 and len(store.steps()) == 2  # keep_checkpoints
    before = [p["version"] for p in read_metrics(out, "push")]
    assert max(before) >= 30

    monkeypatch.delenv(ENV)
    codes = launch(out, resume=True, **flags)
    assert codes == [0, 0, 0], (codes, errors(out))
    summary = json.loads((out / "summary.json").read_text())
    (resume,) = read_metrics(out, "resume")
    assert (resume["version"], resume["step"]) == (version, step) and summary["resumed_at_version"] == version
    raw = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    at = next(i for i, r in enumerate(raw) if r["event"] == "resume")
    redone = [r["version"] for r in raw[at:] if r["event"] == "push"]
    assert redone[0] == version + 1  # it continued at the checkpoint's version, not from 0 nor from 30
    assert [r["version"] for r in raw[:at] if r["event"] == "push"][:version] == list(range(1, version + 1))
    pushes = read_metrics(out, "push")  # the record as it stands: the pushes after the checkpoint are void
    assert [p["version"] for p in pushes] == list(range(1, 61)) and summary["updates"] == 60
    check_every_sample_once_per_epoch(out, summary)
    cut = pushes[version - 1]["data_epoch"]  # the epoch the restart cut: its pending and lost samples dealt again
    assert cut in summary["complete_epochs"] and cut < len(summary["samples_per_epoch"]) - 1


def test_a_stop_signal_makes_the_server_checkpoint_and_stop_the_workers(tmp_path):
    out = tmp_path / "run"
    codes = launch(out, signal_after_pushes=20, workers=2, speeds="1,1", epochs=20,
                   checkpoint_every=1000, heartbeat_s=30.0)
    assert codes == [1, 0, 0], (codes, errors(out))  # the server raised Stopped; the workers were told to stop
    (message,) = errors(out).values()
    assert message.startswith("Stopped: SIGTERM received: stopped at version") and "--resume" in message
    store = CheckpointStore(out / "checkpoints")
    (step,) = store.steps()  # not due (every 1000 steps): the stop's own checkpoint
    version = store.manifest(step)["meta"]["version"]
    assert f"stopped at version {version} after a checkpoint" in message
    assert version >= 20 and max(p["version"] for p in read_metrics(out, "push")) == version


# ------------------------------------------------------------------ through ``omnilearn train`` (the launcher)
CLI = ("--mode", "asp", "--dataset", "mnist1d", "--global-batch", "1000", "--control-interval", "3",
       "--lr-schedule", "constant", "--no-plots")  # RUN's settings, as flags


def test_under_the_launcher_a_killed_worker_is_dropped_and_the_run_succeeds(tmp_path, monkeypatch, capfd):
    out = tmp_path / "run"
    monkeypatch.setenv(ENV, "2:5")  # worker rank 2 dies before its 5th push
    start = time.monotonic()
    # As in the in-process test: a death is seen on its connection, so 4 epochs (no time budget) at any speed.
    code = main(["train", "--out", str(out), "--workers", "3", "--speeds", "1,1,1", "--epochs", "4",
                 "--heartbeat-s", "30", *CLI])
    elapsed = time.monotonic() - start
    err = capfd.readouterr().err
    assert code == 0, err
    warnings = [line for line in err.splitlines() if line.startswith("omnilearn: warning: worker rank")]
    assert warnings == ["omnilearn: warning: worker rank 2 died (killed by SIGKILL); the server dealt its samples "
                        "to the others"], err
    (drop,) = read_metrics(out, "drop")
    assert drop["rank"] == 1 and "its connection failed" in drop["reason"] and drop["live"] == [0, 2]
    summary = json.loads((out / "summary.json").read_text())
    assert drop["data_epoch"] in summary["complete_epochs"]
    check_every_sample_once_per_epoch(out, summary)
    assert list(out.glob("error-rank*.log")) == []  # the others neither failed nor were stopped by the launcher
    print(f"{elapsed:.1f} s, drop at version {drop['version']}, {summary['updates']} updates")


def test_under_the_launcher_a_killed_server_is_restarted_and_resumes(tmp_path, monkeypatch, capfd):
    out = tmp_path / "run"
    monkeypatch.setenv(ENV, "0:30")  # the server dies once it reached version 30 (checkpoints every 8)
    code = main(["train", "--out", str(out), "--workers", "2", "--speeds", "1,1", "--epochs", "3",
                 "--checkpoint-every", "4", "--keep-checkpoints", "2", "--heartbeat-s", "30", "--max-restarts", "1",
                 *CLI])
    err = capfd.readouterr().err
    assert code == 0, err
    assert "omnilearn: the parameter server (rank 0) died (killed by SIGKILL); restart 1 of 1 from the checkpoint " \
           "of step" in err, err
    (resume,) = read_metrics(out, "resume")
    summary = json.loads((out / "summary.json").read_text())
    assert 0 < resume["version"] <= 30 and summary["resumed_at_version"] == resume["version"]
    pushes = read_metrics(out, "push")
    assert [p["version"] for p in pushes] == list(range(1, 61)) and summary["updates"] == 60
    check_every_sample_once_per_epoch(out, summary)
    assert (out / "failures" / "attempt-1").is_dir()


def test_under_the_launcher_a_hung_server_is_named_and_every_process_ends(start_train, wait_for):
    run = start_train("--workers", "2", "--speeds", "1,1", "--epochs", "100", "--max-time-s", "60",
                      "--heartbeat-s", "3", *CLI)
    metrics = run.run_dir / "metrics.jsonl"
    wait_for(lambda: run.proc.poll() is not None or (len(run.worker_pids()) == 3 and metrics.exists()
                                                     and '"event":"push"' in metrics.read_text()),
             HANG_GUARD_S, "the run trains")
    assert run.proc.poll() is None, run.stderr()
    procs = run.processes()
    os.kill(run.worker_pids()[0], signal.SIGSTOP)
    assert run.proc.wait(timeout=HANG_GUARD_S) == 1  # 3 s of silence, then the launcher's grace of 2 s
    last = run.stderr().strip().splitlines()[-1]
    assert last.startswith("omnilearn: error: the parameter server (rank 0) stopped answering: no heartbeat for "
                           "3 s"), run.stderr()
    wait_for(lambda: not run.survivors(procs), HANG_GUARD_S, "every process of the run ends")


# ------------------------------------------------------------------ in-process: who watches whom, blame
def test_in_asp_the_workers_watch_the_server_and_the_server_watches_nobody():
    assert [wd.peers_of(r, 4, "asp") for r in range(4)] == [[], [0], [0], [0]]
    assert [wd.peers_of(r, 4) for r in range(2)] == [[1, 2], [2, 3]]  # BSP: the ring
    store, verdicts = dist.HashStore(), []
    server = wd.Watchdog(store, 0, 3, 0.6, verdicts.append, namespace="server", mode="asp").start()
    time.sleep(1.5)  # its workers never beat: the server's thread does not mind (the server drops them itself)
    server.stop()
    assert verdicts == [] and store.add(server.key(0), 0) > wd.DONE  # it beat, and said goodbye
    worker = wd.Watchdog(store, 1, 3, 0.6, verdicts.append, namespace="worker", mode="asp")
    store.add(worker.key(0), 1)  # the server beat once, then nothing
    assert worker.start().wait(HANG_GUARD_S)  # the verdict comes 0.6 s after the last beat; the wait is a guard
    assert verdicts == ["the parameter server (rank 0) stopped answering: no heartbeat for 0.6 s (hung, stopped or "
                        "dead; --heartbeat-s 0.6)"] and wd.hung_rank(verdicts[0]) == 0


def test_a_fault_point_may_freeze_a_worker_instead_of_killing_it(monkeypatch):
    monkeypatch.setenv(ENV, "2:5:sending:STOP")
    assert kill_point(2) == KillPoint(2, 5, "sending", "STOP") and kill_point(1) is None
    monkeypatch.setenv(ENV, "2:5:after")
    assert kill_point(2) == KillPoint(2, 5, "after", "KILL")
    for bad in ("2:5:after:TERM", "2:5:sending:STOP:1", "0:30:before:STOP"):
        monkeypatch.setenv(ENV, bad)
        with pytest.raises(ValueError, match=r"RANK:COUNT\[:PHASE\[:SIGNAL\]\]"):
            kill_point(2)


def test_in_asp_blame_names_the_parameter_server_and_not_its_workers(tmp_path):
    t = 1000.0
    dead_worker = Exit(2, -signal.SIGKILL, t, ours=False)  # dropped by the server: not the cause
    lost_server = wd.ErrorLog(t + 5.01, 1, "PeerTimeout: the server (rank 0) took no request (Connection reset)")
    dead_server = Exit(0, -signal.SIGKILL, t + 5, ours=False)
    assert blame([dead_worker, dead_server], [lost_server], tmp_path, "asp") == \
        "the parameter server (rank 0) died (killed by SIGKILL)"
    verdict = wd.ErrorLog(t + 6, 2, wd.hung_message(0, 3, mode="asp"))
    killed_by_us = Exit(0, -signal.SIGKILL, t + 9, ours=True)
    assert blame([dead_worker, killed_by_us], [lost_server, verdict], tmp_path, "asp") == \
        f"{verdict.cause} (noticed by rank 2: {tmp_path}/error-rank2.log)"
    assert verdict.cause.startswith("the parameter server (rank 0) stopped answering")
    gone = wd.ErrorLog(t + 1, 0, "WorkersGone: all 2 workers are gone (worker rank 1 ...)")
    assert blame([dead_worker, Exit(0, 1, t + 2, ours=False)], [gone], tmp_path, "asp").startswith(
        "the parameter server (rank 0) failed: WorkersGone: all 2 workers are gone")
    assert blame([dead_worker], [], tmp_path) == "worker rank 2 died (killed by SIGKILL)"  # BSP: every rank counts

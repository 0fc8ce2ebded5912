"""ASP with a parameter server over gloo: exact scaled SGD, staleness, coverage, hung workers, control, evaluation.

A 3-worker run through the CLI counts every push's staleness and covers the data; its controller is fed
scripted cycle times (``OMNILEARN_TEST_S_PER_SAMPLE``, :mod:`omnilearn.asp.control`), so it takes the same
one decision in every run however busy the host is.

A hung worker (alive, silent) is dropped after ``--heartbeat-s`` and the other finishes; with every worker hung
the run fails in one line naming each (killed workers and a killed server: ``tests/faults/test_asp_faults.py``).

Also: the controller sees a slowdown after a long steady phase within two
control intervals (driven push by push, and in a real run with a speed
schedule), and an evaluation longer than ``--timeout-s`` neither stops the
run nor counts as training time.

Run: ``python -m pytest -q tests/dist/test_asp_server.py`` (about two minutes on 2 cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ranks import start_ranks
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cli_run import train
from omnilearn.decisions import SCRIPTED_ENV
from omnilearn.distributed.group import DistContext
from omnilearn.distributed.ps import GO, HELLO, PUSH, STOP, Request
from omnilearn.experiments.train.asp import build_server, build_worker
from omnilearn.experiments.config import TrainConfig
from omnilearn.observe.metrics import read_metrics

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("scaling,stale_aware", [("linear", False), ("none", False), ("linear", True)])
def test_one_push_changes_the_weights_exactly_as_sgd_with_the_scaled_rate(scaling, stale_aware):
    cfg = TrainConfig(mode="asp", workers=2, speeds="1,1", global_batch=64, lr=0.1, momentum=0.9,
                      lr_scaling=scaling, staleness_lr=stale_aware, lr_schedule="constant")
    server = build_server(cfg, None)
    before = [p.detach().clone() for p in server.model.parameters()]
    server.version = 3  # the push was computed on version 1: staleness 2
    grads = [torch.randn_like(p) for p in before]
    buffers = torch.zeros(server.flat.size - server.flat.n_params)
    payload = torch.cat([g.reshape(-1) for g in grads] + [buffers])
    server.apply(0, Request(1, PUSH, 48, 1, 0.1, 0.05, 2.0), payload, 0.0)
    lr = 0.1 * (48 / 32 if scaling == "linear" else 1) / (2 if stale_aware else 1)
    for p, p0, g in zip(server.model.parameters(), before, grads):
        torch.testing.assert_close(p.detach(), p0 - lr * g)  # momentum's first step is plain SGD
    assert server.version == 4 and server.staleness.maxima[0] == 2
    assert server.opt.param_groups[0]["lr"] == 0.1  # the base rate is restored for the next push


class RecordedLink:
    """The server's link with the replies kept instead of sent (a server driven push by push)."""

    def __init__(self) -> None:
        self.replies: list[tuple] = []

    def reply(self, rank, status, version, epoch=0, slowdown=1.0, indices=None, state=None) -> None:
        self.replies.append((rank, status, version, epoch, None if indices is None else list(indices)))


@pytest.mark.parametrize("bound", [None, 2])
def test_a_push_over_the_staleness_bound_is_recomputed_once_on_fresh_weights(bound):
    """``--max-staleness 2``: a push 4 versions old is not applied; the worker gets the current version and the
    same samples; its recomputed push is applied whatever its staleness (no starving); the next batch is bounded
    again. Without a bound every push is applied. Quantiles and refusals are counted."""
    cfg = TrainConfig(mode="asp", workers=2, speeds="1,1", global_batch=64, max_steps=100, lr_schedule="constant",
                      max_staleness=bound, quiet=True)
    server = build_server(cfg, None)
    server.link, server.version = RecordedLink(), 5
    payload = torch.zeros(server.flat.size)

    def push(pulled: int) -> None:
        server.handle(Request(1, PUSH, len(server.outstanding[0][1]), pulled, 0.1, 0.05, 2.0), payload)

    server.outstanding[0] = deal = server.dealer.deal(32)
    push(1)  # 4 versions old
    if bound is None:
        assert server.version == 6 and server.staleness.refused == [0, 0]
        return
    assert server.version == 5 and server.staleness.refused == [1, 0] and server.staleness.counts == [0, 0]
    assert server.outstanding[0] == deal and server.link.replies[-1][1:] == (GO, 5, deal[0], list(deal[1]))
    push(1)  # recomputed, and stale again (the host stalled it once more): applied this time
    assert server.version == 6 and server.staleness.counts[0] == 1 and server.staleness.maxima[0] == 4
    push(2)  # the next batch, 4 versions old: refused again
    assert server.version == 6 and server.staleness.refused == [2, 0]
    push(5)  # recomputed at staleness 1
    assert server.version == 7 and server.staleness.quantile(0.5, 0) == 1 and server.staleness.quantile(0.99) == 4


def test_a_push_applied_within_the_time_budget_counts_within_it(monkeypatch):
    """The budget check and the push's training time are one clock reading (scripted here: each reading 0.6 s
    later), so the last push applied, and the final evaluation the bench counts at its time, fall within the
    budget. Before, a second reading could put a push applied at 0.9 s of a 1 s budget at 1.5 s."""
    cfg = TrainConfig(mode="asp", workers=2, speeds="1,1", global_batch=64, max_steps=100, lr_schedule="constant",
                      max_time_s=1.0, quiet=True)
    server = build_server(cfg, None)
    server.link, logged_s = RecordedLink(), []
    monkeypatch.setattr(server.log, "push", lambda version, worker, req, stale, lr, train_s, *rest: logged_s.append(
        train_s))
    readings = iter(range(1000))
    server.clock.start(0.0)
    monkeypatch.setattr(time, "perf_counter", lambda: 0.9 + 0.6 * next(readings))
    server.outstanding[0] = server.dealer.deal(32)
    server.handle(Request(1, PUSH, 32, 0, 0.1, 0.05, 2.0), torch.zeros(server.flat.size))
    assert server.version == 1 and logged_s == [pytest.approx(0.9)]
    server.handle(Request(1, PUSH, 32, 1, 0.1, 0.05, 2.0), torch.zeros(server.flat.size))
    assert server.version == 1 and server.link.replies[-1][1] == STOP  # past the budget: stopped, not applied


def test_asp_run_accounts_staleness_and_covers_the_data(tmp_path, monkeypatch):
    out = tmp_path / "asp"
    # Scripted cycle times (0.5 ms per sample at full speed, times the emulated slowdown 1/2/4) reach the
    # controller, not measured ones: on a busy host a measured run sometimes made no decision at all (queueing at
    # the server hid the speeds in noise).
    monkeypatch.setenv(SCRIPTED_ENV, "0.0005,0.0005,0.0005")
    summary = train(out, "--mode", "asp", "--workers", "3", "--speeds", "4,2,1", "--global-batch", "192",
                    "--max-steps", "60", "--control-interval", "5", "--no-plots")
    pushes = read_metrics(out, "push")
    assert summary["updates"] == len(pushes) == 60 * 3
    assert [p["version"] for p in pushes] == list(range(1, 181))
    for p in pushes:
        assert p["staleness"] == p["version"] - 1 - p["pulled_version"]  # server version at apply - pulled
    for w in summary["workers"]:
        mine = [p["staleness"] for p in pushes if p["rank"] == w["rank"]]
        assert w["updates"] == len(mine) and w["max_staleness"] == max(mine)
    # Every dealt sample is pushed except those still in flight when the run stopped (one batch per worker).
    in_flight = summary["samples_dealt"] - sum(p["batch"] for p in pushes)
    assert 0 <= in_flight <= 3 * 192
    assert summary["repeated_samples"] == 0 and sum(summary["samples_per_epoch"]) == sum(p["batch"] for p in pushes)
    assert summary["dropped"] == [] and summary["steps"] == 60
    # One change, the same in every run (the proportional rule on the scripted times at 64 each), then holds.
    decisions = read_metrics(out, "decision")
    changes = [(d["old"], d["new"], d["times_s"]) for d in decisions if d["changed"]]
    assert changes == [([64, 64, 64], [110, 55, 27], pytest.approx([0.032, 0.064, 0.128]))], changes
    assert summary["rebalances"] == 1 and len(decisions) == 60 // 5 and summary["test_accuracy"] is not None
    assert read_metrics(out, "eval")


HANG_GUARD_S = 600  # a run of these tests ends in seconds; this only stops a hung one from blocking the suite


def _server_or_worker(rank: int, store: str, out: str, hang_ranks: tuple[int, ...]) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=3)
    cfg = TrainConfig(mode="asp", workers=2, speeds="1,1", global_batch=64, max_steps=60, timeout_s=60.0,
                      heartbeat_s=3.0, lr_schedule="constant", quiet=True)
    ctx = DistContext(rank, 3, rank, 3, torch.device("cpu"), "gloo")
    start = time.perf_counter()
    try:
        if rank == 0:
            summary = build_server(cfg, Path(out)).serve()
            Path(out, "result.json").write_text(json.dumps(summary))
        elif rank in hang_ranks:
            link = build_worker(cfg, ctx).link
            link.request(HELLO, 0, 0, 0.0, 0.0, 0.0)
            time.sleep(HANG_GUARD_S)  # alive but silent: a hung worker (ended by the test once the server ended)
        else:
            build_worker(cfg, ctx).run()
    except Exception as e:  # noqa: BLE001 - the test reads what each rank stopped with
        Path(out, f"rank{rank}.txt").write_text(f"{time.perf_counter() - start:.1f} {e}")


def _run_with_hung(tmp_path: Path, hang_ranks: tuple[int, ...], wait_for: str) -> None:
    """Run until the server (rank 0) wrote ``wait_for`` or ended, however long that takes on a busy host
    (``HANG_GUARD_S`` is only a hang guard), then end every process."""
    ctx = start_ranks(_server_or_worker, (str(tmp_path / "store"), str(tmp_path), hang_ranks), 3, join=False)
    server, since = ctx.processes[0], time.monotonic()
    while not (tmp_path / wait_for).exists() and server.is_alive() and time.monotonic() - since < HANG_GUARD_S:
        time.sleep(0.2)
    for p in ctx.processes:
        p.terminate()
        p.join()


def test_a_hung_worker_is_dropped_named_and_the_other_finishes(tmp_path):
    _run_with_hung(tmp_path, (2,), "result.json")
    summary = json.loads((tmp_path / "result.json").read_text())
    (drop,) = read_metrics(tmp_path, "drop")
    assert drop["rank"] == 1 and "sent nothing for" in drop["reason"] and "--heartbeat-s 3" in drop["reason"]
    assert drop["redealt"] > 0 and drop["batches"] == [64]  # what it held is dealt again; its share moves over
    assert summary["dropped"][0]["rank"] == 1 and summary["repeated_samples"] == 0
    assert summary["workers"][1]["updates"] == 0 and summary["workers"][0]["updates"] > 0
    assert not (tmp_path / "rank1.txt").exists()  # the live worker finished normally


def test_with_every_worker_hung_the_run_fails_naming_each(tmp_path):
    _run_with_hung(tmp_path, (1, 2), "rank0.txt")
    _seconds, message = (tmp_path / "rank0.txt").read_text().split(" ", 1)
    assert message.startswith("all 2 workers are gone") and "\n" not in message
    assert "worker rank 1 sent nothing for" in message and "worker rank 2 sent nothing for" in message
    # Dropped for 3 s of silence (--heartbeat-s 3), not after --timeout-s 60: the rule named says which fired (no
    # clock asserted: a busy host may take longer to notice, never a different rule).
    assert "--heartbeat-s 3" in message and "--timeout-s" not in message and "--resume" in message


def test_torchrun_rank_zero_is_the_server(tmp_path):
    out = tmp_path / "torchrun-asp"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
           "-m", "omnilearn", "train", "--mode", "asp", "--speeds", "2,1", "--max-steps", "10",
           "--global-batch", "128", "--control-interval", "4", "--out", str(out), "--no-plots"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mode"] == "asp" and summary["updates"] == 20 and len(summary["workers"]) == 2


# ------------------------------------------------------------------ (a) the controller does not go blind
def _push(server, worker: int, cycle_s: float) -> None:
    """One push of worker ``worker`` at its current batch with this cycle time (a zero gradient)."""
    batch = server.batches[worker]
    server.apply(worker, Request(worker + 1, PUSH, batch, server.version, cycle_s, cycle_s / 2, 1.0),
                 torch.zeros(server.flat.size), 0.0)


def test_controller_sees_a_slowdown_after_400_steady_pushes_within_two_intervals():
    cfg = TrainConfig(mode="asp", workers=2, speeds="1,1", global_batch=128, control_interval=10, max_steps=2000,
                      lr_schedule="constant", quiet=True)
    server = build_server(cfg, None)
    interval = cfg.control_interval * cfg.workers
    noise = torch.Generator().manual_seed(0)

    def cycle(base_s: float) -> float:
        return base_s * (1 + 0.02 * float(torch.randn(1, generator=noise)))

    for _ in range(200):  # 400 steady pushes at equal speeds: the controller holds
        for w in (0, 1):
            _push(server, w, cycle(0.020))
    assert server.batches == (64, 64) and server.log.events.rebalances == 0
    slowed_at, rounds = server.version, 0
    while server.batches == (64, 64) and server.version < slowed_at + 3 * interval:
        rounds += 1
        _push(server, 0, cycle(0.020))  # the fast worker pushes three times as often as the slowed one
        if rounds % 3 == 0:
            _push(server, 1, cycle(0.060 * server.batches[1] / 64))  # 3x slower per sample from here on
        assert server.control.held_times <= interval  # only the current window is kept
    assert server.version <= slowed_at + 2 * interval, "no reaction within two control intervals"
    assert server.batches[0] > 64 > server.batches[1] and sum(server.batches) == 128


def test_real_run_sees_a_slowdown_after_400_steady_pushes_within_two_intervals(tmp_path, monkeypatch):
    """End to end through the CLI and a speed schedule, with scripted cycle times that follow the emulated
    slowdown the server sends (measured ones once reacted a third interval late on a busy host): the
    schedule's change reaches the controller's windows, which react within two intervals. Before, a settled
    controller's unbounded history hid any slowdown for about as many pushes as the steady phase had."""
    monkeypatch.setenv(SCRIPTED_ENV, "0.001:0.0001,0.001:0.0001")
    schedule = tmp_path / "slowdown.toml"
    schedule.write_text('[[change]]\nat_step = 0\nspeeds = [8, 8]\n\n[[change]]\nat_step = 200\nspeeds = [8, 1]\n')
    out, interval = tmp_path / "slowdown", 10 * 2
    train(out, "--mode", "asp", "--workers", "2", "--speed-schedule", str(schedule), "--global-batch", "256",
          "--max-steps", "260", "--control-interval", "10", "--lr-schedule", "constant", "--no-plots")
    change = [c["version"] for c in read_metrics(out, "speeds") if c["speeds"] == [8, 1]][0]
    assert 400 <= change <= 402  # the first reply at or after step 200 carries the slowdown
    reacted = [d["step"] for d in read_metrics(out, "decision")
               if d["changed"] and d["step"] > change and d["new"][1] < d["old"][1]]
    assert reacted and reacted[0] <= change + 2 * interval, (change, reacted)


# ------------------------------------------------ (b) evaluation is not silence, and not training time
EVAL_SLEEP_S = 7.0  # over the --timeout-s of 5 below (a timeout short enough to lapse, long enough for a busy host)


def _slow(evaluate, model):
    time.sleep(EVAL_SLEEP_S)  # longer than --timeout-s: the workers must be held, not lost
    return evaluate(model)


def _server_with_slow_eval(rank: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=3)
    # 39 steps per epoch: one evaluation mid-run. Uniform batches: with the measured controller a busy host once
    # moved the split so far that 90 pushes dealt under one epoch of samples, and the mid-run evaluation never came.
    cfg = TrainConfig(mode="asp", workers=2, speeds="1,1", global_batch=256, max_steps=45, timeout_s=5.0,
                      controller="uniform", lr_schedule="constant", quiet=True)
    ctx = DistContext(rank, 3, rank, 3, torch.device("cpu"), "gloo")
    try:
        if rank == 0:
            server = build_server(cfg, Path(out))
            inner = server.evaluate
            server.evaluate = lambda model: _slow(inner, model)
            start = time.perf_counter()
            summary = server.serve()
            summary["outer_wall_s"] = time.perf_counter() - start
            Path(out, "result.json").write_text(json.dumps(summary))
        else:
            build_worker(cfg, ctx).run()
    except Exception as e:  # noqa: BLE001 - the test reads what each rank stopped with
        Path(out, f"rank{rank}.txt").write_text(f"{type(e).__name__}: {e}")
    finally:
        dist.destroy_process_group()


def test_an_evaluation_longer_than_the_timeout_does_not_stop_the_run(tmp_path):
    start_ranks(_server_with_slow_eval, (str(tmp_path / "store"), str(tmp_path)), 3)
    errors = {f.name: f.read_text() for f in tmp_path.glob("rank*.txt")}
    assert not errors, errors
    summary = json.loads((tmp_path / "result.json").read_text())
    assert summary["updates"] == 90  # every push applied, those held during the evaluation too
    pushes = read_metrics(tmp_path, "push")
    assert [p["version"] for p in pushes] == list(range(1, 91))
    evals = read_metrics(tmp_path, "eval")
    assert len(evals) == 2 and evals[0]["epoch"] == 0  # after the first epoch, and at the end
    # The mid-run evaluation is a pause: left out of the training time (the final one is outside wall_s too).
    assert summary["wall_s"] - summary["train_s"] >= EVAL_SLEEP_S
    assert summary["outer_wall_s"] >= summary["wall_s"] + EVAL_SLEEP_S
    assert max(p["wall_s"] for p in pushes) <= summary["train_s"]

"""ASP with a parameter server over gloo: one push is exact scaled SGD, staleness, coverage, dead workers.

Run: ``python -m pytest -q tests/dist/test_asp_server.py`` (under a minute on 2 cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cli_run import train
from omnilearn.asp.runtime import SERVER_ALONE, ASPWorker, ParameterServer
from omnilearn.experiments.config import TrainConfig
from omnilearn.distributed.group import DistContext
from omnilearn.distributed.ps import HELLO, PUSH, Request
from omnilearn.observe.rundir import read_metrics

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("scaling,stale_aware", [("linear", False), ("none", False), ("linear", True)])
def test_one_push_changes_the_weights_exactly_as_sgd_with_the_scaled_rate(scaling, stale_aware):
    cfg = TrainConfig(mode="asp", workers=2, speeds="1,1", global_batch=64, lr=0.1, momentum=0.9,
                      lr_scaling=scaling, staleness_lr=stale_aware, lr_schedule="constant")
    server = ParameterServer(cfg, SERVER_ALONE, None)
    before = [p.detach().clone() for p in server.model.parameters()]
    server.version = 3  # the push was computed on version 1: staleness 2
    grads = [torch.randn_like(p) for p in before]
    buffers = torch.zeros(server.flat.size - server.flat.n_params)
    payload = torch.cat([g.reshape(-1) for g in grads] + [buffers])
    server._apply(0, Request(1, PUSH, 48, 1, 0.1, 0.05, 2.0), payload, 0.0)
    lr = 0.1 * (48 / 32 if scaling == "linear" else 1) / (2 if stale_aware else 1)
    for p, p0, g in zip(server.model.parameters(), before, grads):
        torch.testing.assert_close(p.detach(), p0 - lr * g)  # momentum's first step is plain SGD
    assert server.version == 4 and server.staleness.maxima[0] == 2
    assert server.opt.param_groups[0]["lr"] == 0.1  # the base rate is restored for the next push


def test_asp_run_accounts_staleness_and_covers_the_data(tmp_path):
    out = tmp_path / "asp"
    summary = train(out, "--mode", "asp", "--workers", "3", "--speeds", "4,2,1", "--global-batch", "192",
                    "--max-steps", "40", "--control-interval", "5", "--no-plots")
    pushes = read_metrics(out, "push")
    assert summary["updates"] == len(pushes) == 40 * 3
    assert [p["version"] for p in pushes] == list(range(1, 121))
    for p in pushes:
        assert p["staleness"] == p["version"] - 1 - p["pulled_version"]  # server version at apply - pulled
    for w in summary["workers"]:
        mine = [p["staleness"] for p in pushes if p["rank"] == w["rank"]]
        assert w["updates"] == len(mine) and w["max_staleness"] == max(mine)
    # Every dealt sample is pushed except those still in flight when the run stopped (one batch per worker).
    in_flight = summary["samples_dealt"] - sum(p["batch"] for p in pushes)
    assert 0 <= in_flight <= 3 * 192
    assert summary["rebalances"] >= 1 and summary["test_accuracy"] is not None
    assert read_metrics(out, "eval")


def _server_or_worker(rank: int, store: str, out: str, hang_rank: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=3)
    cfg = TrainConfig(mode="asp", workers=2, speeds="1,1", global_batch=64, max_steps=10_000, timeout_s=4.0)
    ctx = DistContext(rank, 3, rank, 3, torch.device("cpu"), "gloo")
    start = time.perf_counter()
    try:
        if rank == 0:
            ParameterServer(cfg, ctx, None).serve()
        elif rank == hang_rank:
            link = ASPWorker(cfg, ctx).link
            link.request(HELLO, 0, 0, 0.0, 0.0, 0.0)
            time.sleep(60)  # alive but silent: a hung worker
        else:
            ASPWorker(cfg, ctx).run()
    except Exception as e:  # noqa: BLE001 - the test reads what each rank stopped with
        Path(out, f"rank{rank}.txt").write_text(f"{time.perf_counter() - start:.1f} {e}")


def test_a_hung_worker_stops_the_server_with_its_rank_named(tmp_path):
    ctx = mp.start_processes(_server_or_worker, args=(str(tmp_path / "store"), str(tmp_path), 2), nprocs=3,
                             join=False, start_method="spawn")
    deadline = time.time() + 60
    files = [tmp_path / "rank0.txt", tmp_path / "rank1.txt"]
    while not all(f.exists() for f in files) and time.time() < deadline:
        time.sleep(0.5)
    for p in ctx.processes:
        p.terminate()
    seconds, message = files[0].read_text().split(" ", 1)
    assert "worker rank 2 sent nothing" in message and "--timeout-s 4" in message
    assert float(seconds) < 40  # 4 s of silence, plus start-up on a busy 2-core host
    assert files[1].exists()  # the live worker does not hang either: it loses the server and stops


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

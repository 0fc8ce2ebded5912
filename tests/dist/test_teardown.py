"""Teardown leaves no gloo machinery for interpreter finalisation (the abort at exit), on real 2-rank gloo groups.

The abort ("terminate called without an active exception", SIGABRT): a
gloo worker thread that ends a collective while the interpreter finalises
must take the GIL to drop the tensors it held; Python ends such a thread
mid-C++ and the C++ runtime aborts (docs/failures.md, "The abort at exit").
So no gloo thread may outlive the teardown:

- after ``close()`` no gloo thread is left in the process, and the session
  and its DDP model are freed once the caller lets go (before: a cycle
  through DDP's C++ reducer, which the collector cannot see, kept them
  forever, and ``torch.distributed.nn.functional``'s default arguments kept
  the group: its threads ran until the process ended); the released model
  still computes, as its module;
- a rank whose collective timed out (``sync_buffers()`` on rank 0 only) and
  that exits without ``close()`` exits cleanly: the exit teardown destroys
  the group while Python still runs (before: SIGABRT at exit, about 5 runs
  in 6 of the same pattern in plain PyTorch, docs/upstream.md);
- the hook state holds the session's methods weakly;
- the ASP server joins its evaluation thread when ``serve()`` fails.

Run: ``python -m pytest -q tests/dist/test_teardown.py``
"""

from __future__ import annotations

import gc
import os
import threading
import time
import weakref
from datetime import timedelta
from pathlib import Path

import pytest
from ranks import start_ranks
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import omnilearn
from omnilearn.bsp.backward import HookState
from omnilearn.experiments.train.asp import build_server
from omnilearn.experiments.config import TrainConfig

pytestmark = pytest.mark.dist


def gloo_threads() -> list[str]:
    """Names of this process's threads that belong to gloo (its TCP loop, the process group's workers)."""
    return sorted(name for name in map(thread_name, os.listdir("/proc/self/task")) if "gloo" in name)


def thread_name(tid: str) -> str:
    """A thread's name, or "" for one that ended after the listing (a race seen once in a whole-suite run)."""
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip()
    except FileNotFoundError:
        return ""


def _data(n: int = 64) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(n, 6, generator=g), torch.randint(3, (n,), generator=g))


def _close_worker(rank: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    ol = omnilearn.setup(global_batch=16, control_interval=3, device="cpu")
    model = ol.wrap_model(nn.Linear(6, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in ol.data_loader(_data()):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ol.step(loss)
    ol.finish()
    during = gloo_threads()
    ol.close()
    x = torch.randn(2, 6)
    same = torch.equal(model(x), model.module(x))
    refs = [weakref.ref(ol), weakref.ref(model)]
    del ol, model, opt
    gc.collect()
    torch.save({"during": during, "after": gloo_threads(), "alive": [r() is not None for r in refs], "same": same},
               f"{out}/rank{rank}.pt")


def test_close_ends_the_groups_threads_and_frees_session_and_model(tmp_path):
    start_ranks(_close_worker, (str(tmp_path / "store"), str(tmp_path)), 2)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert got["during"], "no gloo thread seen while the group was up: the check below would prove nothing"
        assert got["after"] == [], f"rank {rank}: gloo threads left after close(): {got['after']}"
        assert got["alive"] == [False, False], f"rank {rank}: session, model still alive after close(): {got['alive']}"
        assert got["same"], "the released model does not compute as its module"


def _timed_out_worker(rank: int, store: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=2))
    ol = omnilearn.setup(global_batch=16, control_interval=3, device="cpu")
    ol.wrap_model(nn.Linear(6, 3))
    timed_out = Path(store + ".timed-out")
    if rank == 0:
        with pytest.raises(RuntimeError, match="sync_buffers"):
            ol.sync_buffers()  # rank 1 never comes: the collective times out and is still running when we exit
        timed_out.touch()
    else:  # leave after rank 0 has begun to exit: its collective ends when this rank's sockets close
        for _ in range(6000):  # a hang guard (10 min), not a deadline: rank 0 says when its wait timed out
            if timed_out.exists():
                break
            time.sleep(0.1)
        time.sleep(0.5)


def test_a_rank_leaving_a_timed_out_collective_exits_cleanly(tmp_path):
    # Without the exit teardown rank 0 dies of SIGABRT at exit and this raises ProcessExitedException.
    start_ranks(_timed_out_worker, (str(tmp_path / "store"),), 2)


def test_hook_state_holds_bound_methods_weakly():
    class Session:
        def ready(self) -> None:
            pass

    session = Session()
    state = HookState(on_ready=session.ready, on_reduced=lambda last: None)
    assert state.on_ready is not None
    ref = weakref.ref(session)
    del session
    assert ref() is None and state.on_ready is None  # a strong reference would keep the session alive
    assert state.on_reduced is not None  # a plain function is held as given


def test_the_asp_server_joins_its_evaluation_thread_when_serve_fails():
    server = build_server(TrainConfig(mode="asp", workers=2, speeds="1,1", global_batch=64, dataset="synthetic"), None)
    server.evaluate = lambda model: time.sleep(0.5) or (0.0, 0.0)
    server.start_evaluation(0)

    def fail():
        raise RuntimeError("a gloo error")

    server.members.start = lambda: None  # no workers: nothing to connect to
    server.members.receive = fail
    with pytest.raises(RuntimeError, match="a gloo error"):
        server.serve()
    evaluating = [t.name for t in threading.enumerate() if t.name.startswith("omnilearn-eval")]
    assert evaluating == [], f"the evaluation thread outlived serve(): {evaluating}"

"""Start a test's rank processes as the launcher starts its workers: from the preloaded fork server.

:func:`start_ranks` is ``torch.multiprocessing.start_processes`` with the
launcher's start method (:func:`omnilearn.experiments.launch.supervise.start_context`:
a fork server that imported torch and OmniLearn once, so a rank starts in
milliseconds) and the test's environment, stdout and stderr as they are at the
call (:func:`~omnilearn.experiments.launch.supervise.launch_env`): what a test
set with ``monkeypatch.setenv`` reaches its ranks, and ``capfd`` sees them.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

from omnilearn.decisions import SCRIPTED_ENV
from omnilearn.experiments.launch.supervise import in_launch_env, launch_env, start_context

SPEEDS_4_2_1 = "0.00025,0.0005,0.001"  # scripted per-sample times of speeds 4, 2, 1: the same plan changes every run


def start_ranks(fn: Callable[..., None], args: tuple, nprocs: int, **kwargs: Any):
    """``fn(rank, *args)`` in ``nprocs`` processes; ``kwargs`` go to ``start_processes`` (``join=False``...)."""
    method = start_context().get_start_method()
    return mp.start_processes(in_launch_env, args=(*launch_env(fn), *args), nprocs=nprocs, start_method=method,
                              **kwargs)


def scripted_rank_results(fn: Callable[..., None], args: tuple, out: Path, nprocs: int = 3,
                          times: str = SPEEDS_4_2_1) -> list[dict]:
    """``start_ranks(fn, args, nprocs)`` with the controller reading the scripted ``times`` (the spawned ranks
    inherit the variable; this process's is restored after), then each rank's ``out/rank<r>.pt``."""
    saved = os.environ.get(SCRIPTED_ENV)
    os.environ[SCRIPTED_ENV] = times
    try:
        start_ranks(fn, args, nprocs)
    finally:
        if saved is None:
            os.environ.pop(SCRIPTED_ENV, None)
        else:
            os.environ[SCRIPTED_ENV] = saved
    return [torch.load(Path(out) / f"rank{r}.pt", weights_only=True) for r in range(nprocs)]


def max_relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest relative difference ``|a - b| / |b|`` over the tensors of ``b`` (two state dicts)."""
    return max(float((a[k] - b[k]).norm() / b[k].norm()) for k in b)


def free_port() -> int:
    """A TCP port free on the loopback interface now (for a rendezvous the test sets up itself)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

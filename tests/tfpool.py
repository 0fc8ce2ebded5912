"""One TensorFlow fork server per pytest process for the runs the tests make in it, not one per run.

``omnilearn train --framework tensorflow`` and ``omnilearn launch`` start a
:class:`~omnilearn.experiments.launch.tfforks.ForkServer` per run
(:func:`omnilearn.experiments.launch.tfworkers.fork_server`): it imports TensorFlow and Keras (about 6 s of CPU on
the 2-core machine) and forks the run's workers. A CLI process makes one run, so that is paid once; the suite calls
the CLI's ``main`` in-process for dozens of runs. :func:`shared_fork_server` stands in for ``fork_server`` in the
tests: it keeps the last server and hands it to the next run whose environment is the same in everything that the
server's imports read (the interpreter's start-up: ``PYTHON*``, the frameworks' settings: ``KERAS_*``, ``TF_*``,
``CUDA_*``, thread and library settings, and the working directory); otherwise it closes it and starts another. A
worker forked from a kept server is what it would be from a fresh one: the server only imports, then forks (its
children get their own environment, directory and descriptors from each task). Runs through a fresh server per run
stay covered by the tests that start the CLI as a process (tests/tf/test_tf_launch.py, tests/faults).
:func:`run_scripts` forks the workers a test would start by hand (``python SCRIPT`` with its own ``TF_CONFIG``)
from the same kept servers.

Run: ``python -m pytest -q tests/tf``
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from omnilearn.experiments.launch import tfworkers
from omnilearn.experiments.launch.tfforks import ForkServer

IMPORT_ENV = ("PYTHON", "KERAS", "TF_", "CUDA", "OMP_", "MKL", "OPENBLAS", "LD_", "XLA", "NVIDIA")
RUN_ENV = ("TF_CONFIG",)  # read when the worker runs, not at import: each worker has its own
_kept: dict[tuple, ForkServer] = {}


def import_key(env: dict[str, str]) -> tuple:
    """What a server's imports read: the environment variables they may read, and the working directory."""
    return (tuple(sorted((k, v) for k, v in env.items() if k.startswith(IMPORT_ENV) and k not in RUN_ENV)),
            os.getcwd())


@contextlib.contextmanager
def shared_fork_server(workers: int, device: str, run_dir: Path, command: list[str],
                       network: str = "private") -> Iterator[ForkServer | None]:
    """``tfworkers.fork_server``, the server kept across runs with the same :func:`import_key` and network."""
    if tfworkers.start_method() == "spawn":
        yield None
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    yield kept(tfworkers.common_env(workers, device), tfworkers.log_path(run_dir, 0), command, network == "private")


def kept(env: dict[str, str], log: Path, command: list[str], isolate: bool = True) -> ForkServer:
    """The kept server for ``env``'s :func:`import_key` (and ``isolate``: a private network, as the launcher's),
    or a new one started with ``env`` (its own standard error into ``log``) after the last is closed."""
    key = (import_key(env), isolate)
    server = _kept.get(key)
    if server is None or server.ended or server.proc.poll() is not None:
        close()
        server = _kept[key] = ForkServer(env, log, command, isolate=isolate)
    return server


def run_scripts(argvs: list[list[str]], envs: list[dict[str, str]], logs: Path,
                timeout: float = 600) -> list[subprocess.CompletedProcess]:
    """``python ARGV`` per worker, each with its environment (one import environment for all), forked from the
    kept server: what a test would get from ``subprocess.Popen`` per worker, without TensorFlow's import in each.
    Standard output and error are kept in ``logs``; a worker still running after ``timeout`` (a hang guard, not a
    deadline) is killed, and every worker is when one was."""
    logs.mkdir(parents=True, exist_ok=True)
    keys = {import_key(env) for env in envs}
    assert len(keys) == 1, "one import environment for the workers of a run"
    server = kept(envs[0], logs / "server.log", [sys.executable, *argvs[0]])
    global _next
    ranks = list(range(_next, _next + len(argvs)))
    _next += len(argvs)
    procs = [server.start(rank, argv, env, logs / f"{rank}.err", console=logs / f"{rank}.out")
             for rank, argv, env in zip(ranks, argvs, envs)]
    end = time.monotonic() + timeout
    while any(p.poll() is None for p in procs) and time.monotonic() < end:
        server.pump(wait_s=0.05)
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    return [subprocess.CompletedProcess([sys.executable, *argv], p.returncode, _read(logs / f"{rank}.out"),
                                        _read(logs / f"{rank}.err")) for rank, argv, p in zip(ranks, argvs, procs)]


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


_next = 1000  # the ranks the kept server knows these workers by: never a launcher's 0..n-1


def close() -> None:
    """End the kept server (at the end of the session, or before another is started)."""
    while _kept:
        _kept.popitem()[1].close()

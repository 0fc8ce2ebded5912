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

Run: ``python -m pytest -q tests/tf``
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from omnilearn.experiments.launch import tfworkers
from omnilearn.experiments.launch.tfforks import ForkServer

IMPORT_ENV = ("PYTHON", "KERAS", "TF_", "CUDA", "OMP_", "MKL", "OPENBLAS", "LD_", "XLA", "NVIDIA")
_kept: dict[tuple, ForkServer] = {}


def import_key(env: dict[str, str]) -> tuple:
    """What a server's imports read: the environment variables they may read, and the working directory."""
    return (tuple(sorted((k, v) for k, v in env.items() if k.startswith(IMPORT_ENV))), os.getcwd())


@contextlib.contextmanager
def shared_fork_server(workers: int, device: str, run_dir: Path, command: list[str]) -> Iterator[ForkServer | None]:
    """``tfworkers.fork_server``, the server kept across runs with the same :func:`import_key`."""
    if tfworkers.start_method() == "spawn":
        yield None
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    env = tfworkers.common_env(workers, device)
    key = import_key(env)
    server = _kept.get(key)
    if server is None or server.ended or server.proc.poll() is not None:
        close()
        server = _kept[key] = ForkServer(env, tfworkers.log_path(run_dir, 0), command)
    yield server


def close() -> None:
    """End the kept server (at the end of the session, or before another is started)."""
    while _kept:
        _kept.popitem()[1].close()

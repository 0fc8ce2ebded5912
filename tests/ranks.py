"""Start a test's rank processes as the launcher starts its workers: from the preloaded fork server.

:func:`start_ranks` is ``torch.multiprocessing.start_processes`` with the
launcher's start method (:func:`omnilearn.experiments.launch.supervise.start_context`:
a fork server that imported torch and OmniLearn once, so a rank starts in
milliseconds) and the test's environment, stdout and stderr as they are at the
call (:func:`~omnilearn.experiments.launch.supervise.launch_env`): what a test
set with ``monkeypatch.setenv`` reaches its ranks, and ``capfd`` sees them.
"""

from __future__ import annotations

from typing import Any, Callable

import torch.multiprocessing as mp

from omnilearn.experiments.launch.supervise import in_launch_env, launch_env, start_context


def start_ranks(fn: Callable[..., None], args: tuple, nprocs: int, **kwargs: Any):
    """``fn(rank, *args)`` in ``nprocs`` processes; ``kwargs`` go to ``start_processes`` (``join=False``...)."""
    method = start_context().get_start_method()
    return mp.start_processes(in_launch_env, args=(*launch_env(fn), *args), nprocs=nprocs, start_method=method,
                              **kwargs)

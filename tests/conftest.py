"""Shared test fixtures: a private data cache per session, no leftover process groups or stop handlers.

Run everything with the README's command from the repository root: ``python -m pytest -q -n 3 --dist loadfile``
(pytest-xdist: three worker processes on the two cores, each taking whole files, so a module's shared runs are
made once; with two, the cores were idle a third of the time while tests waited on their ranks, sleeps and
timeouts: docs/results.md). Each worker has its own data cache, fork servers and temp directories; nothing here is
shared between them. The dearest files are handed out first, and a whole run fails when one file takes more than
its budgeted share of the suite (tests/suitecost.py).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import suitecost
import tfpool
import torch

from omnilearn.experiments.launch import supervise, tfworkers

# The tests' rank processes fork from the launcher's preloaded fork server (tests/ranks.py); it imports the
# frameworks the tests' ranks use as well, once per xdist worker, instead of once per rank (Lightning's import
# takes 8.7 s of CPU on the 2-core machine, transformers' 1.3 s). Must be set before the server starts.
# quickexit stays last (its exit freezes what the imports made: tests/unit/test_launch_store.py).
supervise.PRELOAD = (*supervise.PRELOAD[:-1], *(name for name in ("transformers", "lightning.pytorch")
                                                if importlib.util.find_spec(name.split(".")[0]) is not None),
                     supervise.PRELOAD[-1])

# One intra-op thread in the test processes and in what they start (a CLI, torchrun, a script; the launcher's
# ranks set their own share): the suite runs several processes at once on two cores, and OpenMP threads that
# wait by spinning then take the cores from the processes doing the work (an in-process float64 reference ran
# 7x faster on one thread on a busy host: tests/dist/test_bsp.py).
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

# What torchrun sets (and Hugging Face's accelerate sets in a process of its own): left behind by a test, the
# next launch reads it as "under torchrun" ("--workers 2 does not match torchrun's WORLD_SIZE 1").
TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS")


@pytest.fixture(scope="session", autouse=True)
def _data_cache(tmp_path_factory):
    """Generate MNIST-1D once per session into a temp cache (never touches ~/.cache)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("OMNILEARN_CACHE", str(tmp_path_factory.mktemp("cache")))
    yield
    mp.undo()


def _restore_torchrun_env(before: dict) -> None:
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session", autouse=True)
def _one_tensorflow_fork_server():
    """The runs made in this process share a TensorFlow fork server while their import environment is the same
    (tests/tfpool.py); closed at the end."""
    mp = pytest.MonkeyPatch()
    mp.setattr(tfworkers, "fork_server", tfpool.shared_fork_server)
    yield
    mp.undo()
    tfpool.close()


@pytest.fixture(autouse=True)
def _no_leftover_torchrun_env():
    before = {key: os.environ.get(key) for key in TORCHRUN_ENV}
    yield
    _restore_torchrun_env(before)


@pytest.fixture(scope="module", autouse=True)
def _no_leftover_torchrun_env_from_a_module():
    """Also what a module-scoped fixture left (a one-process Lightning fit sets WORLD_SIZE, MASTER_ADDR, ...): the
    files after it in the same xdist worker would launch as if under torchrun."""
    before = {key: os.environ.get(key) for key in TORCHRUN_ENV}
    yield
    _restore_torchrun_env(before)


@pytest.fixture(autouse=True)
def _no_leftover_group():
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _no_leftover_stop_handlers():
    """``omnilearn.setup()`` in this process installs SIGTERM/SIGINT handlers: put pytest's back after each test."""
    yield
    from omnilearn import stopping

    stopping.restore_handlers()
    stopping.clear()


# ------------------------------------------------------------------ the suite's cost: dearest files first, a budget
_COSTS, _BUDGET = suitecost.load()
_SECONDS: list[tuple[str, float]] = []  # (nodeid, seconds) of every phase, on the xdist controller (or alone)
_REPORT: list[str] = []


def pytest_collection_modifyitems(session, config, items):
    """The dearest files first (tests/suitecost.py): xdist hands out whole files in this order."""
    items[:] = suitecost.order(items, lambda item: item.nodeid, _COSTS)


def pytest_runtest_logreport(report):
    _SECONDS.append((report.nodeid, report.duration))


def pytest_sessionfinish(session, exitstatus):
    """A whole run (not a worker's part, not a chosen file): the slowest files, and exit 1 when one is over budget."""
    if hasattr(session.config, "workerinput"):
        return
    files = suitecost.per_file(_SECONDS)
    if len(files) < suitecost.WHOLE_RUN_FILES or exitstatus not in (0, 1):
        return
    _REPORT[:] = suitecost.report(files, _BUDGET)
    if suitecost.over_budget(files, _BUDGET) and exitstatus == 0:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter):
    for line in _REPORT:
        terminalreporter.write_line(line)

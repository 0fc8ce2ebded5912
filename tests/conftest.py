"""Shared test fixtures: a private data cache per session, no leftover process groups or stop handlers.

Run everything with ``python -m pytest -q`` from the repository root.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def _data_cache(tmp_path_factory):
    """Generate MNIST-1D once per session into a temp cache (never touches ~/.cache)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("OMNILEARN_CACHE", str(tmp_path_factory.mktemp("cache")))
    yield
    mp.undo()


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

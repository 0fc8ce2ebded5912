"""The launcher's rendezvous directory: a SIGKILLed launcher's is removed by the next launch on the machine.

Found by an operator trial (kill -9 the launcher: its workers die with it, but ``omnilearn-store-*`` stayed in
TMPDIR). Also: the fork server exits without the final garbage collections (``quickexit``).
Run: ``python -m pytest -q tests/unit/test_launch_store.py``
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from omnilearn.experiments.launch import local as launch


def test_a_new_launch_removes_the_store_of_a_launcher_that_is_gone(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = tmp_path / f"{launch.STORE_PREFIX}{int(gone.stdout)}-abc123"  # that process has exited
    alive = tmp_path / f"{launch.STORE_PREFIX}{os.getppid()}-def456"  # a launcher still running: kept
    other = tmp_path / f"{launch.STORE_PREFIX}xyz"  # not ours to judge (no pid in the name): kept
    for d in (dead, alive, other):
        (d / "store").mkdir(parents=True)
    made = launch.private_store_dir()
    assert not dead.exists() and alive.exists() and other.exists()
    assert os.path.basename(made).startswith(f"{launch.STORE_PREFIX}{os.getpid()}-") and os.path.isdir(made)


def test_the_fork_server_leaves_its_objects_out_of_the_collections_at_exit():
    """The fork server preloads ``quickexit`` last: at its exit the objects of torch's import are frozen, so the
    final collections skip them (a second of CPU after every launch). Read in an exit hook that runs after it."""
    from omnilearn.experiments.launch import supervise

    assert supervise.PRELOAD[-1] == "omnilearn.experiments.launch.quickexit"
    code = ("import atexit, gc, sys; atexit.register(lambda: sys.stdout.write(f'frozen {gc.get_freeze_count()}'));"
            "import torch, omnilearn.experiments.launch.quickexit")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split()[-1]) > 100_000  # torch's objects; 0 without the module


def test_no_freeze_where_a_nanobind_extension_would_call_every_frozen_object_a_leak():
    """With triton loaded (torch._dynamo imports it on torch's CUDA builds), nanobind prints "leaked N instances!"
    for every object the exit's collections leave, frozen ones included (torch 2.15.0+cu132, triton 3.9): there
    the exit collects as usual. A stand-in module named triton is enough to show the choice."""
    code = ("import atexit, gc, sys, types;"
            "atexit.register(lambda: sys.stdout.write(f'frozen {gc.get_freeze_count()}'));"
            "sys.modules['triton'] = types.ModuleType('triton');"
            "import torch, omnilearn.experiments.launch.quickexit")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split()[-1]) == 0

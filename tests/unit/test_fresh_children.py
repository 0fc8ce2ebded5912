"""Workers forked from a launcher's fork server start as spawned interpreters would: their own random state and a
fresh interpreter's signal handling (:mod:`omnilearn.experiments.launch.freshchild`).

- TensorFlow's fork server (:mod:`omnilearn.experiments.launch.tfforks`, numpy.random preloaded, as torch and TensorFlow import it, no TensorFlow here): two
  workers and a restart of one draw different numpy and ``random`` numbers; each worker's signal dispositions (SIGPIPE
  ignored, SIGINT ``default_int_handler``, ...) and signal mask are those of ``python SCRIPT`` started by the launcher.
- PyTorch's fork server (multiprocessing's ``forkserver``, numpy.random preloaded, as torch and TensorFlow import it): the same, for ranks run through
  :func:`~omnilearn.experiments.launch.supervise.in_launch_env`.

Run: ``python -m pytest -q tests/unit/test_fresh_children.py``
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from omnilearn.experiments.launch.tfforks import ForkServer

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fork servers are Linux's")

PROBE = Path(__file__).with_name("freshprobe.py")


def _read(out: Path, name: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob(f"{name}-*.json"))]


def _assert_like_fresh(forked: list[dict], fresh: dict) -> None:
    assert len({f["numpy"] for f in forked}) == len(forked), "forked workers drew the same numpy numbers"
    assert len({f["random"] for f in forked}) == len(forked), "forked workers drew the same random numbers"
    for f in forked:
        assert f["signals"][str(int(signal.SIGPIPE))] == "ignored"  # as CPython sets it at start
        assert f["signals"] == fresh["signals"] and f["blocked"] == fresh["blocked"]


def test_tf_fork_server_children_are_fresh_interpreters(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(PROBE.parent), os.environ.get("PYTHONPATH")]))}
    subprocess.run([sys.executable, str(PROBE), str(tmp_path), "fresh"], check=True, env=env)  # as tfworkers spawns
    with ForkServer(env, tmp_path / "server.log", [sys.executable, str(PROBE)], preload=("numpy.random",)) as server:
        for rank in (0, 1, 0):  # two workers, then a restart of worker 0
            worker = server.start(rank, [str(PROBE), str(tmp_path), "forked"], env, tmp_path / f"w{rank}.log", False)
            assert worker.wait() == 0, (tmp_path / f"w{rank}.log").read_text()
    _assert_like_fresh(_read(tmp_path, "forked"), _read(tmp_path, "fresh")[0])


def test_pytorch_fork_server_ranks_are_fresh_interpreters(tmp_path):
    tmpdir = tempfile.mkdtemp(prefix="olfresh-")  # short: the fork server's socket lives there
    try:
        env = {**os.environ, "TMPDIR": tmpdir, "PYTHONPATH": os.pathsep.join(
            filter(None, [str(PROBE.parent), os.environ.get("PYTHONPATH")]))}
        env.pop("OMNILEARN_START_METHOD", None)
        done = subprocess.run([sys.executable, str(PROBE), str(tmp_path), "--forkserver"], capture_output=True,
                              text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    forked = [f for r in (0, 1) for f in _read(tmp_path, str(r))]
    assert len(forked) == 3
    _assert_like_fresh(forked, _read(tmp_path, "fresh")[0])

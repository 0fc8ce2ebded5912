"""Helpers for the example tests: run an example under ``torchrun`` with a slow worker and read its run directory.

Each example is a script in ``examples/`` that writes an OmniLearn run
directory (``--out``). The tests run it as a user would (``torchrun
--standalone --nproc-per-node 2``, rank 1 emulated slower) and check what
the run directory says: the fast worker ended with the larger batch, and the
loss fell. The controller is fed scripted timings in the ratio of the
emulated speeds (:func:`scripted_timings`), so it takes the same decisions
in every run: on a busy host measured compute times can come out within the
controller's noise margin, and a run then rightly keeps the even split.

Run: ``python -m pytest -q tests/examples``
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import agents
import pytest

from omnilearn.decisions import SCRIPTED_ENV
from omnilearn.experiments.report.records import load_run
from omnilearn.observe.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def scripted_timings(speeds: str) -> dict[str, str]:
    """The environment that feeds the controller times in the ratio of ``speeds`` (0.1 ms per sample at the fastest)."""
    values = [float(v) for v in speeds.split(",")]
    return {SCRIPTED_ENV: ",".join(f"{1e-4 * max(values) / v:g}" for v in values)}


def torchrun(script: str, *args: str, nproc: int = 2, timeout: float = 300, env: dict | None = None,
             check: bool = True, forked: bool = True) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node nproc examples/<script> args``; its output is shown on failure.

    ``forked``: torchrun's agent forks the ranks from the tests' preloaded fork server (tests/agents.py: the same
    script, its imports already done); ``False``: ``python -m torch.distributed.run`` as a user types it."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(EXAMPLES / script), *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    if forked:
        done = agents.torchrun(*cmd[3:], env=full_env, timeout=timeout, cwd=ROOT)
    else:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=ROOT)
    if check and done.returncode != 0:
        pytest.fail(f"{' '.join(cmd[2:])} exited {done.returncode}\n--- stdout\n{done.stdout[-4000:]}"
                    f"\n--- stderr\n{done.stderr[-6000:]}")
    return done


def assert_balanced_and_learning(run_dir: Path, slow_rank: int = 1, fast_rank: int = 0) -> dict:
    """The run was fed :func:`scripted_timings`, moved batch toward the fast worker and its loss fell; its summary."""
    run = load_run(run_dir)
    speeds = read_metrics(run_dir, "speeds")[0]["speeds"]
    first = read_metrics(run_dir, "decision")[0]
    fed = [float(t) for t in scripted_timings(",".join(map(str, speeds)))[SCRIPTED_ENV].split(",")]
    assert first["times_s"] == pytest.approx([c * b for c, b in zip(fed, first["old"])]), "not fed scripted timings"
    batches = run.per_rank["batch"]
    first, last = batches[fast_rank][0], batches[fast_rank][-1]
    assert batches[slow_rank][0] == first, f"the run did not start from an even split: {batches[slow_rank][0]}/{first}"
    assert last > batches[slow_rank][-1], (f"the fast worker's batch {last} is not above the slow worker's "
                                           f"{batches[slow_rank][-1]} at the end")
    losses = [x for x in run.loss_by_step if not math.isnan(x)]
    assert len(losses) >= 10, f"only {len(losses)} steps logged a loss"
    k = max(3, len(losses) // 5)
    head, tail = sum(losses[:k]) / k, sum(losses[-k:]) / k
    assert tail < head, f"the loss did not fall: {head:.4f} over the first {k} steps, {tail:.4f} over the last {k}"
    assert run.summary is not None, f"{run_dir} has no summary.json"
    return run.summary

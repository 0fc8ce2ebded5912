"""examples/ray_train.py runs as a user runs it, on a local Ray cluster (``RAY_ADDRESS``): 2 workers, 20 steps.

Run: ``python -m pytest -q tests/ray/test_ray_example.py``
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray.train")  # tests/ray itself would pass for a namespace package called ray

from raycluster import local_cluster  # noqa: E402

pytestmark = pytest.mark.dist
EXAMPLE = Path(__file__).parents[2] / "examples" / "ray_train.py"


def test_the_example_runs_on_the_cluster(tmp_path):
    with local_cluster(head_cpus=2) as cluster:
        env = {**os.environ, "RAY_ADDRESS": cluster.address, "PYTHONPATH": str(EXAMPLE.parents[1] / "src")}
        done = subprocess.run([sys.executable, str(EXAMPLE), "--storage", str(tmp_path), "--workers", "2",
                               "--steps", "20"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "trained 20 steps on 2 workers" in done.stdout, done.stdout[-2000:]

"""A real ``omnilearn train`` start-up says what it is doing, phase by phase, before the first step.

Run: ``python -m pytest -q tests/dist/test_startup.py`` (two local gloo workers, about 10 s on 2 cores).
"""

from __future__ import annotations

import os
import subprocess
import sys


def test_every_start_up_phase_has_a_line_from_the_launcher_or_rank_0(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "omnilearn", "train", "--speeds", "2,1", "--max-steps", "6", "--control-interval", "3",
         "--no-plots", "--out", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"})  # a hang guard
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    expected = [
        "omnilearn: checking the data (mnist1d",  # ", generating it once" in a fresh cache, then the model
        "omnilearn: data: mnist1d: 10,000 training + 2,500 test samples",
        "omnilearn: model: cnn1d, 31,498 parameters",
        "omnilearn: 2 workers, speeds 2,1, controller model, global batch 512, 6 steps, run directory",
        "omnilearn: starting 2 worker processes (gloo, cpu; speeds emulated by delay) ...",
        "omnilearn: 2 processes up and joined in ",
        "omnilearn: rank 0: data loaded in ",  # then: model ready on cpu in DDP in .. s
        "omnilearn: training starts: 6 steps, 19 per epoch; a progress line every 3 steps",
        "step     3/6 ",
    ]
    found = [next((i for i, line in enumerate(lines) if line.startswith(e)), None) for e in expected]
    assert None not in found and found == sorted(found), proc.stdout
    assert sum(line.startswith("omnilearn: rank 0:") for line in lines) == 1  # rank 1 says nothing
    assert proc.stderr == ""

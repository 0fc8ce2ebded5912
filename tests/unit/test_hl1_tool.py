"""``tools/hl1_breakdown.py``: its refusals, and the interval it prints around the median ratio.

The interval resamples the pairs: with nothing but noise between the loops it must contain 1, and it must
narrow as the pairs grow (what lets a reader tell a 3% cost from the machine's spread).

Run: ``python -m pytest -q tests/unit/test_hl1_tool.py``
"""

from __future__ import annotations

import importlib.util
import random
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "hl1_breakdown.py"


def load_tool():
    spec = importlib.util.spec_from_file_location("hl1_breakdown", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_interval_holds_the_median_and_narrows_with_more_pairs():
    spread = load_tool().spread
    rng = random.Random(1)
    few = [rng.lognormvariate(0, 0.3) for _ in range(12)]
    many = [rng.lognormvariate(0, 0.3) for _ in range(1200)]
    for values in (few, many):
        low, high = spread(values)
        assert low <= sorted(values)[len(values) // 2] <= high
        assert low < 1.0 < high  # noise around a ratio of 1: the interval holds 1
    assert spread(many)[1] - spread(many)[0] < (spread(few)[1] - spread(few)[0]) / 4
    assert spread([1.02] * 30) == (1.02, 1.02)
    assert spread(few) == spread(few)  # seeded: a rerun prints the same interval


@pytest.mark.parametrize("args, named", [
    (["--window-cost", "-1"], "--window-cost -1"),
    (["--profile", "-5"], "--profile -5"),
    (["--aa", "--window-cost", "10"], "--window-cost"),
])
def test_bad_arguments_are_refused_in_one_line_before_any_process_group(args, named):
    done = subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert named in done.stderr and "Traceback" not in done.stderr
    assert len([line for line in done.stderr.splitlines() if "error" in line]) == 1

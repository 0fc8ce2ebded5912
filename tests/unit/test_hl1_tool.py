"""``tools/hl1_breakdown.py`` (and its FSDP2 twin): their refusals, and the interval it prints around the median ratio.

The interval resamples the pairs: with nothing but noise between the loops it must contain 1, and it must
narrow as the pairs grow (what lets a reader tell a 3% cost from the machine's spread).

Run: ``python -m pytest -q tests/unit/test_hl1_tool.py``
"""

from __future__ import annotations

import importlib.util
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "hl1_breakdown.py"
FSDP2_TOOL = TOOL.with_name("fsdp2_breakdown.py")


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


@pytest.mark.parametrize("tool, args, named", [
    (TOOL, ["--window-cost", "-1"], "--window-cost -1"),
    (TOOL, ["--profile", "-5"], "--profile -5"),
    (TOOL, ["--aa", "--window-cost", "10"], "--window-cost"),
    (TOOL, ["--blocks", "0"], "--blocks 0: give 1 or more"),
    (TOOL, ["--steps", "-3"], "--steps -3: give 1 or more"),
    (TOOL, [], "run it under torchrun"),
    (FSDP2_TOOL, ["--vocab", "0"], "--vocab 0: give 1 or more"),
    (FSDP2_TOOL, [], "torchrun --standalone --nproc-per-node 2 tools/fsdp2_breakdown.py"),
])
def test_bad_arguments_are_refused_in_one_line_before_any_process_group(tool, args, named):
    env = {k: v for k, v in os.environ.items() if k != "RANK"}
    done = subprocess.run([sys.executable, str(tool), *args], capture_output=True, text=True, timeout=120, env=env,
                          cwd=tool.parents[1])
    assert done.returncode == 2
    assert named in done.stderr and "Traceback" not in done.stderr
    assert len([line for line in done.stderr.splitlines() if "error" in line]) == 1


def test_fsdp2_tool_refuses_heads_that_do_not_divide_the_width():
    env = {**os.environ, "RANK": "0"}  # past the torchrun check: the width's refusal comes before any group
    done = subprocess.run([sys.executable, str(FSDP2_TOOL), "--heads", "3"], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 2 and "--width 64 is not a multiple of --heads 3" in done.stderr

"""``tools/hl1_breakdown.py`` (and its FSDP2 twin): their refusals, and the interval it prints around the median ratio.

The interval resamples the pairs: with nothing but noise between the loops it must contain 1, and it must
narrow as the pairs grow (what lets a reader tell a 3% cost from the machine's spread). The refusals run each
tool's ``main()`` in this process (argparse's exit 2, its one ``error:`` line, no process group made): a
subprocess each cost an import of torch, 4-6 s apiece, 50 s of the suite (issue 53).

Run: ``python -m pytest -q tests/unit/test_hl1_tool.py``
"""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "hl1_breakdown.py"
FSDP2_TOOL = TOOL.with_name("fsdp2_breakdown.py")


def load_tool(path: Path = TOOL):
    sys.path.insert(0, str(path.parent))  # fsdp2_breakdown imports hl1_breakdown's helpers
    try:
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module


def refused(tool: Path, args: list[str], monkeypatch, capsys) -> str:
    """``tool``'s ``main()`` with ``args``, in this process, from the repository root: its stderr; it must exit 2
    and leave no process group."""
    import torch.distributed as dist

    monkeypatch.chdir(tool.parents[1])
    monkeypatch.setattr(sys, "argv", [str(tool), *args])
    main = load_tool(tool).main
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == 2 and not dist.is_initialized()
    return capsys.readouterr().err


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
def test_bad_arguments_are_refused_in_one_line_before_any_process_group(tool, args, named, monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    err = refused(tool, args, monkeypatch, capsys)
    assert named in err and "Traceback" not in err
    assert len([line for line in err.splitlines() if "error" in line]) == 1


def test_fsdp2_tool_refuses_heads_that_do_not_divide_the_width(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")  # past the torchrun check: the width's refusal comes before any group
    assert "--width 64 is not a multiple of --heads 3" in refused(FSDP2_TOOL, ["--heads", "3"], monkeypatch, capsys)

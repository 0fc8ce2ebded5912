"""What each test file costs the suite: run the dearest files first, and fail a whole run where one file's share grew.

``tests/suite_costs.json`` holds the seconds each file took in the last measured whole run (pytest's durations of
set-up, call and teardown summed per file, over both xdist workers; ``python tools/suite_times.py LOG --write
tests/suite_costs.json`` writes it from a run with ``--durations=0``) and the budget: the largest share of the
suite's summed seconds one file may take.

- :func:`order` sorts the collected tests so that the dearest files come first, each file's tests in their own
  order (xdist's ``loadfile`` hands out whole files in collection order: a long file started last would run alone
  at the end while the other worker idles).
- :func:`over_budget` names the files whose share of a whole run's seconds is above the budget. The conftest's
  hooks sum every test's durations per file on the xdist controller and, for a run of the whole suite, print the
  slowest files and fail the run (exit 1) when one is over. A share is measured side by side in one run, so a
  slow or loaded machine moves every file alike; no wall-clock time is asserted.

Pure: no torch, no pytest. Run: ``python -m pytest -q tests/unit/test_suite_times.py``
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TypeVar

COSTS = Path(__file__).with_name("suite_costs.json")
WHOLE_RUN_FILES = 80  # a run of this many files or more is the whole suite: the budget applies
T = TypeVar("T")


def load(path: Path = COSTS) -> tuple[dict[str, float], float]:
    """The seconds per file and the budget share from ``path``."""
    data = json.loads(path.read_text(encoding="utf-8"))
    return {str(k): float(v) for k, v in data["files"].items()}, float(data["budget_share"])


def file_of(nodeid: str) -> str:
    """``tests/x/test_y.py::test_z[a]`` -> ``tests/x/test_y.py``."""
    return nodeid.split("::", 1)[0]


def order(items: Sequence[T], nodeid_of, costs: dict[str, float]) -> list[T]:
    """``items`` with the dearest files first (a stable sort: a file's tests, and files of equal or unknown cost,
    keep their order)."""
    return sorted(items, key=lambda item: -costs.get(file_of(nodeid_of(item)), 0.0))


def per_file(durations: Iterable[tuple[str, float]]) -> dict[str, float]:
    """``(nodeid, seconds)`` pairs (every phase of every test) summed per file."""
    files: dict[str, float] = {}
    for nodeid, seconds in durations:
        name = file_of(nodeid)
        files[name] = files.get(name, 0.0) + seconds
    return files


def over_budget(files: dict[str, float], budget_share: float) -> list[tuple[str, float]]:
    """The files whose share of the summed seconds is above ``budget_share``, with their share, dearest first."""
    total = sum(files.values())
    if total <= 0:
        return []
    return sorted(((name, s / total) for name, s in files.items() if s / total > budget_share), key=lambda x: -x[1])


def report(files: dict[str, float], budget_share: float, top: int = 8) -> list[str]:
    """Lines for the end of a run: the ``top`` slowest files with their share, then the verdict."""
    total = sum(files.values()) or 1.0
    lines = [f"the suite's slowest files (share of {total:.0f} s summed over the workers; budget "
             f"{budget_share:.0%} a file, tests/suite_costs.json):"]
    for name, s in sorted(files.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {s:7.1f} s {s / total:6.1%}  {name}")
    over = over_budget(files, budget_share)
    if over:
        lines.append("suite budget exceeded: " + ", ".join(f"{n} takes {s:.1%}" for n, s in over)
                     + f" of the suite (budget {budget_share:.0%}): make it cheaper (share a launch, run fewer steps), "
                     "then rewrite tests/suite_costs.json with tools/suite_times.py --write")
    return lines

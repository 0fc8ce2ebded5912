"""Where the test suite's time goes, per file: set-up (fixtures: most of the process launches) against test bodies.

Reads the output of a run with every test's durations and prints the slowest files: their set-up (module and
function fixtures: a shared launch of rank processes, a fork server, TensorFlow started), call (the test bodies,
launches made inside a test included) and teardown seconds, their sum, and the share of the whole. On two
pytest-xdist workers the files' sum is about twice the wall time.

    PYTEST_ADDOPTS="--durations=0" python -m pytest -q -n 3 --dist loadfile > suite.log
    python tools/suite_times.py suite.log [--top 30] [--write tests/suite_costs.json]

``--write`` stores each file's seconds in the costs file the suite reads (tests/suitecost.py: the dearest files
run first, and a whole run fails when one file's share is over the budget stated there).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

LINE = re.compile(r"^\s*(?P<s>\d+(?:\.\d+)?)s (?P<phase>setup|call|teardown)\s+(?P<file>[^:\s]+)::")
PHASES = ("setup", "call", "teardown")
DEFAULT_BUDGET = 0.09  # a new costs file's largest share of the suite for one file


def per_file(text: str) -> dict[str, dict[str, float]]:
    """Seconds per file and phase, from pytest's ``--durations`` lines."""
    files: dict[str, dict[str, float]] = defaultdict(lambda: dict.fromkeys(PHASES, 0.0))
    for line in text.splitlines():
        m = LINE.match(line)
        if m:
            files[m["file"]][m["phase"]] += float(m["s"])
    return dict(files)


def table(files: dict[str, dict[str, float]], top: int) -> list[str]:
    """The ``top`` slowest files as aligned lines, the total last."""
    total = sum(sum(p.values()) for p in files.values()) or 1.0
    ranked = sorted(files.items(), key=lambda kv: -sum(kv[1].values()))[:top]
    rows = [f"{'file':60s} {'setup s':>8s} {'call s':>8s} {'tear s':>7s} {'total s':>8s} {'share':>6s}"]
    for name, p in ranked:
        s = sum(p.values())
        rows.append(f"{name:60s} {p['setup']:8.1f} {p['call']:8.1f} {p['teardown']:7.1f} {s:8.1f} {s / total:6.1%}")
    rows.append(f"{'all ' + str(len(files)) + ' files':60s} {'':8s} {'':8s} {'':7s} {total:8.1f} {1:6.0%}")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log", help="the output of a pytest run with --durations=0")
    ap.add_argument("--top", type=int, default=30, help="how many files (default 30)")
    ap.add_argument("--write", metavar="JSON", help="also write each file's seconds into this costs file (the "
                    "suite's order and budget: tests/suite_costs.json), keeping its budget_share")
    args = ap.parse_args(argv)
    if args.top < 1:
        print(f"suite_times: --top {args.top}: give 1 or more", file=sys.stderr)
        return 2
    path = Path(args.log)
    if not path.is_file():
        print(f"suite_times: {path}: no such file; run the suite with PYTEST_ADDOPTS=--durations=0 into it first",
              file=sys.stderr)
        return 2
    files = per_file(path.read_text(encoding="utf-8", errors="replace"))
    if not files:
        print(f"suite_times: {path} holds no durations: run pytest with --durations=0", file=sys.stderr)
        return 2
    budget = DEFAULT_BUDGET
    if args.write:
        budget = kept_budget(Path(args.write))
        if isinstance(budget, str):
            print(f"suite_times: --write {args.write}: {budget}", file=sys.stderr)
            return 2
    print("\n".join(table(files, args.top)))
    if args.write:
        write_costs(Path(args.write), files, budget)
    return 0


def kept_budget(path: Path) -> float | str:
    """The ``budget_share`` of the costs file at ``path`` (the default for a new one), or why it cannot be written."""
    if not path.parent.is_dir():
        return f"no directory {str(path.parent)!r}; give a path in an existing directory"
    if not path.exists():
        return DEFAULT_BUDGET
    try:
        budget = json.loads(path.read_text(encoding="utf-8"))["budget_share"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"not a costs file with a budget_share ({type(e).__name__}); fix it or give a new path"
    if not isinstance(budget, (int, float)) or not 0 < budget < 1:
        return f"budget_share {budget!r} must be a share between 0 and 1, e.g. 0.09"
    return float(budget)


def write_costs(path: Path, files: dict[str, dict[str, float]], budget: float) -> None:
    """Each file's summed seconds into ``path`` (a temporary file renamed over it), with ``budget``."""
    seconds = {name: round(sum(p.values()), 1) for name, p in sorted(files.items(), key=lambda kv: -sum(kv[1].values()))}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"budget_share": budget, "files": seconds}, indent=1) + "\n", encoding="utf-8")
    tmp.replace(path)


if __name__ == "__main__":
    sys.exit(main())

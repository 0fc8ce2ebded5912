"""Where the test suite's time goes, per file: set-up (fixtures: most of the process launches) against test bodies.

Reads the output of a run with every test's durations and prints the slowest files: their set-up (module and
function fixtures: a shared launch of rank processes, a fork server, TensorFlow started), call (the test bodies,
launches made inside a test included) and teardown seconds, their sum, and the share of the whole. On two
pytest-xdist workers the files' sum is about twice the wall time.

    PYTEST_ADDOPTS="--durations=0" python -m pytest -q -n 2 --dist loadfile > suite.log
    python tools/suite_times.py suite.log [--top 30]
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path

LINE = re.compile(r"^\s*(?P<s>\d+(?:\.\d+)?)s (?P<phase>setup|call|teardown)\s+(?P<file>[^:\s]+)::")
PHASES = ("setup", "call", "teardown")


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
    print("\n".join(table(files, args.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Reading ``metrics.jsonl`` back: a cut last line tolerated, a resumed run seen once.

:func:`parse_jsonl` reads the JSON lines; a line cut by a crash mid-write is
left out with one warning when it is the last line or a ``resume`` event
follows it; a bad line elsewhere is an error naming the file and the line.
:func:`replay` applies the one rule every reader uses for resumed runs: a
``resume`` event at step k (BSP) or version v (ASP) voids the earlier records
of what the resumed run redid. :func:`read_metrics` is both, for one event,
with BSP's ``step`` events from each rank's ``steps/rank-<r>.jsonl``
(:func:`read_rank_rows`, the same rule file by file).
Writing is :mod:`omnilearn.observe.rundir`'s.

Run its tests: ``python -m pytest -q tests/unit/test_rundir.py tests/unit/test_report.py``
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Iterable

from omnilearn.observe.rundir import STEPS_DIR, RunDirError

_warned: set[tuple[str, int]] = set()  # (file, line) already warned about


def _warn_cut(path: Path, line: int, resumed: bool) -> None:
    key = (os.path.abspath(path), line)
    if key in _warned:
        return
    _warned.add(key)
    what = ("is cut (the run stopped there and was resumed); skipping it" if resumed
            else f"is cut; using the {line - 1} lines before it")
    print(f"omnilearn: warning: {path} line {line} {what}", file=sys.stderr)


def parse_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a ``.jsonl`` file (blank lines skipped).

    A line cut by a crash mid-write is left out with one warning on stderr
    when it is the last line, or when a ``resume`` event follows it (the run
    was resumed after the crash); any other bad line raises
    :class:`RunDirError` naming the file and the line.
    """
    records: list[dict[str, Any]] = []
    bad: tuple[int, str] | None = None  # a line that is not JSON, unless it proves to be the cut one

    def damaged(n: int, why: str) -> RunDirError:
        return RunDirError(f"{path}: line {n} is not JSON ({why}); the file is damaged there: "
                           "repair or delete that line")

    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                if bad is not None:
                    raise damaged(*bad) from None
                bad = (n, e.msg)
                continue
            if not isinstance(rec, dict):
                raise RunDirError(f"{path}: line {n} is not a JSON object; the file is damaged there: "
                                  "repair or delete that line")
            if bad is not None:
                if rec.get("event") != "resume":
                    raise damaged(*bad)
                _warn_cut(path, bad[0], resumed=True)
                bad = None
            records.append(rec)
    if bad is not None:
        _warn_cut(path, bad[0], resumed=False)
    return records


def _position(rec: dict[str, Any], field: str) -> int | None:
    value = rec.get(field)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _redone(rec: dict[str, Any], resume: dict[str, Any]) -> bool:
    """Whether ``rec``, written before ``resume``, tells of work the resumed run did again.

    ASP (the resume has ``version`` v: v pushes applied and checkpointed): a
    ``push``, ``eval``, ``speeds`` or ``resume`` after version v, a ``decision``
    (its ``step`` is the server version) after v. BSP (``step`` k: steps 0..k-1
    done): a ``step`` or ``decision`` (made after its step) of step k or later,
    an ``eval`` or ``speeds`` (their ``step`` counts finished steps) after k, an
    earlier ``resume`` at k or later. Records without the position field stay.
    """
    event = rec.get("event")
    version = _position(resume, "version")
    if version is not None:
        at = _position(rec, "step" if event == "decision" else "version")
        return at is not None and (at >= version if event == "resume" else at > version)
    step = _position(resume, "step")
    at = _position(rec, "step")
    if step is None or at is None:
        return False
    return at > step if event in ("eval", "speeds") else at >= step


def _boundary(rec: dict[str, Any], resume: dict[str, Any]) -> tuple[str, int] | None:
    """(event, position) of an ``eval`` or ``speeds`` record at exactly the resume's position, else None.

    Such a record may come from before the checkpoint or after it: it is kept, unless the resumed run
    writes one of the same event at the same position again.
    """
    field = "version" if _position(resume, "version") is not None else "step"
    at = _position(rec, field)
    if rec.get("event") in ("eval", "speeds") and at is not None and at == _position(resume, field):
        return rec["event"], at
    return None


def replay(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records as the run stands after its resumes: each ``resume`` drops what came before it and was redone.

    An ``eval`` or ``speeds`` at exactly the resume's position stays unless the resumed run writes it again.
    Every reader of ``metrics.jsonl`` goes through this, so a resumed run reads as one run, each step once.
    """
    out: list[dict[str, Any]] = []
    resume: dict[str, Any] | None = None
    tentative: dict[tuple[str, int], dict[str, Any]] = {}  # records at the last resume's position
    for rec in records:
        if rec.get("event") == "resume":
            out = [r for r in out if not _redone(r, rec)]
            resume, tentative = rec, {key: r for r in out if (key := _boundary(r, rec)) is not None}
        elif resume is not None and (key := _boundary(rec, resume)) in tentative:
            old = tentative.pop(key)
            out = [r for r in out if r is not old]
        out.append(rec)
    return out


def read_rank_rows(run_dir: Path) -> list[dict[str, Any]]:
    """Every rank's ``step`` events from ``RUN_DIR/steps/rank-<r>.jsonl`` as the run stands (each file replayed:
    its ``resume`` events void what was redone), ordered by step, then rank; none for a run without that folder."""
    folder = Path(run_dir) / STEPS_DIR
    if not folder.is_dir():
        return []
    rows = [r for path in sorted(folder.glob("rank-*.jsonl")) for r in replay(parse_jsonl(path))
            if r.get("event") == "step"]
    return sorted(rows, key=lambda r: (r.get("step", 0), r.get("rank", 0)))


def read_metrics(run_dir: Path, event: str | None = None) -> list[dict[str, Any]]:
    """``RUN_DIR/metrics.jsonl`` as the run stands (:func:`parse_jsonl`, then :func:`replay`), of one ``event``;
    BSP's ``step`` events of every rank's file (:func:`read_rank_rows`) come after its own records."""
    records = replay(parse_jsonl(Path(run_dir) / "metrics.jsonl"))
    if event in (None, "step"):
        records += read_rank_rows(run_dir)
    return [r for r in records if event is None or r.get("event") == event]

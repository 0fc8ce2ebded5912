"""A run record that ``omnilearn.setup(out=..., overwrite=True)`` replaces, held until the run shows whether it
resumes it.

A script that resumes (``ol.load_checkpoint(dir)``) is re-run as the same command after a preemption (Slurm's
requeue, a Kubernetes restart): a new job, not a torchrun restart of the old one, so the run directory's record
would be cleared by ``overwrite=True`` before the script knew it resumes. Instead :func:`hold` moves the record
into ``RUN_DIR/.replaced`` (renames only), and then:

- a resume takes its lines back (:func:`reclaim`, called where each record file gets its ``resume`` event:
  ``metrics.jsonl`` on rank 0, each rank's ``steps/rank-<r>.jsonl`` on that rank): the held lines first, then the
  lines this run wrote since (in place: the writers append with ``O_APPEND``), so the readers' replay voids the
  steps redone after the resume event as for any resume;
- the first control interval's rows end the wait (:func:`drop`, rank 0): what is still held (the record of a run
  that was not resumed; a resumed run's stale summary, final model, error logs) is removed.

A ``.replaced`` already there (an attempt that stopped before deciding) is kept as the record to decide on; what
that attempt wrote is cleared.

Run: ``python -m pytest -q tests/unit/test_heldrun.py``
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

HELD = ".replaced"


def hold(path: Path, names: list[str]) -> None:
    """Move ``names`` (the record's files and folders in ``path``) into ``path/.replaced``, or remove them when an
    earlier attempt's held record is there already."""
    held = Path(path) / HELD
    keep = not held.exists()
    held.mkdir(exist_ok=True)
    for name in names:
        item = Path(path) / name
        if keep:
            os.replace(item, held / name)
        elif item.is_dir():
            shutil.rmtree(item)
        else:
            item.unlink()


def reclaim(path: Path | None, name: str) -> None:
    """The held ``name`` (a record file, relative to ``path``) back in place, before what this run wrote to it."""
    if path is None:
        return
    old, new = Path(path) / HELD / name, Path(path) / name
    if not old.is_file():
        return
    new.parent.mkdir(parents=True, exist_ok=True)
    with open(new, "a+b") as f:  # the writer's descriptor appends (O_APPEND): its next lines go after these
        f.seek(0)
        since = f.read()
        f.seek(0)
        f.truncate()
        f.write(whole_lines(old.read_bytes()) + since)
    old.unlink()


def whole_lines(data: bytes) -> bytes:
    """``data`` up to its last whole JSON line (a line cut by a kill dropped; a whole one lacking its newline
    completed), as :class:`omnilearn.observe.rundir.MetricsLog` mends a file it opens."""
    if not data or data.endswith(b"\n"):
        return data
    cut = data.rfind(b"\n") + 1
    try:
        whole = isinstance(json.loads(data[cut:]), dict)
    except ValueError:
        whole = False
    return data + b"\n" if whole else data[:cut]


def held_rows(path: Path | None, steps_dir: str) -> list[str]:
    """The names (``steps/rank-<r>.jsonl``) of the ranks' row files still held."""
    folder = Path(path) / HELD / steps_dir if path is not None else None
    return sorted(f"{steps_dir}/{p.name}" for p in folder.glob("rank-*.jsonl")) if folder and folder.is_dir() else []


def drop(path: Path | None) -> None:
    """Remove what is still held (nothing when nothing is)."""
    if path is not None and (Path(path) / HELD).is_dir():
        shutil.rmtree(Path(path) / HELD, ignore_errors=True)

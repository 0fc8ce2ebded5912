"""A run directory's records as written, for tests that check what a crash or a resume left (no replay).

``metrics.jsonl`` holds rank 0's events; BSP's ``step`` events are in each
rank's ``steps/rank-<r>.jsonl`` (:mod:`omnilearn.observe.rankrows`).
:func:`raw_events` reads both as written, duplicates of a resumed run
included: the library's readers (``read_metrics``) replay them instead.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from omnilearn.checkpoint import CheckpointStore


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def raw_events(run: Path, kind: str | None = None) -> list[dict]:
    """``kind`` events as written: ``metrics.jsonl`` in order, then every rank's ``step`` events (rank by rank, in
    order; the ``resume`` events of those files mark what was voided and are not repeated here)."""
    records = _lines(Path(run) / "metrics.jsonl") if (Path(run) / "metrics.jsonl").exists() else []
    for path in rank_files(run):
        records += [r for r in _lines(path) if r.get("event") == "step"]
    return [r for r in records if kind is None or r.get("event") == kind]


def rank_files(run: Path) -> list[Path]:
    folder = Path(run) / "steps"
    return sorted(folder.glob("rank-*.jsonl"), key=lambda p: int(p.stem.split("-")[1])) if folder.is_dir() else []


def after_last_resume(run: Path, kind: str) -> list[dict]:
    """``kind`` events each file holds after its last ``resume`` event (all of them where it has none)."""
    out = []
    for path in [Path(run) / "metrics.jsonl", *rank_files(run)]:
        records = _lines(path) if path.exists() else []
        resumes = [i for i, r in enumerate(records) if r.get("event") == "resume"]
        out += [r for r in records[(resumes[-1] if resumes else 0):] if r.get("event") == kind]
    return out


def has_step_rows(run: Path) -> bool:
    """Whether training has written a step row yet (any rank's file)."""
    return any('"event":"step"' in p.read_text() for p in rank_files(run))


def stopped_at(src: Path, dst: Path, step: int) -> Path:
    """``src``'s run directory as it was when a run stopped right after its checkpoint of ``step``."""
    shutil.copytree(src, dst)
    store = CheckpointStore(dst / "checkpoints")
    for later in [s for s in store.steps() if s > step]:
        store.path(later).with_suffix(".json").unlink()
        store.path(later).unlink()
    for name in ("model.pt", "summary.json"):
        (dst / name).unlink()
    return dst

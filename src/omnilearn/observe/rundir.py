"""Run directory: ``config.toml``, ``metrics.jsonl``, ``summary.json``, ``model.pt``.

``metrics.jsonl`` holds one JSON object per line with an ``event`` field:
``step`` (BSP: one per step per worker), ``push`` (ASP: one per applied
gradient), ``decision`` (one per controller decision), ``speeds`` (an
emulated speed change) and ``eval`` (test metrics). Only rank 0 writes, through
:class:`omnilearn.observe.events.EventRecorder`. ``summary.json`` and
``model.pt`` are written atomically (temp file, fsync, rename): a crash leaves
the old file or the new one, never half of one.

Run its tests: ``python -m pytest -q tests/unit/test_recorder.py``
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, BinaryIO, Callable

RUN_FILES = ("config.toml", "metrics.jsonl", "summary.json", "model.pt")


class RunDirError(ValueError):
    """The output directory cannot be used as asked."""


def default_out() -> Path:
    base = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    out, k = base, 1
    while out.exists():
        out, k = Path(f"{base}-{k}"), k + 1
    return out


def prepare(out: str | None, overwrite: bool, config_toml: str) -> Path:
    """Check and create the run directory, then write ``config.toml`` into it."""
    path = default_out() if out is None else Path(out)
    if path.exists() and not path.is_dir():
        raise RunDirError(f"--out {str(path)!r} is a file, not a directory; choose another --out")
    previous = [f for f in RUN_FILES if (path / f).exists()]
    if previous and not overwrite:
        raise RunDirError(
            f"--out {str(path)!r} already holds a run ({', '.join(previous)}); "
            "choose another --out or pass --overwrite"
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
        for f in [*previous, *(p.name for p in path.glob("error-rank*.log"))]:
            (path / f).unlink()
        (path / "config.toml").write_text(config_toml, encoding="utf-8")
    except OSError as e:
        raise RunDirError(f"cannot use --out {str(path)!r}: {e.strerror}") from None
    return path


class MetricsLog:
    """Appends JSON lines to ``metrics.jsonl`` (rank 0 only)."""

    def __init__(self, run_dir: Path) -> None:
        self.file = open(run_dir / "metrics.jsonl", "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def write_atomic(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Write ``path`` through ``write(file)`` into a temp file beside it, fsync it, then rename it over ``path``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    try:  # the rename itself survives a crash once the directory is synced (not possible everywhere)
        fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_model(run_dir: Path, model) -> None:
    """``RUN_DIR/model.pt``: the model's ``state_dict`` as CPU tensors (``torch.load(..., weights_only=True)``)."""
    import torch

    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    write_atomic(Path(run_dir) / "model.pt", lambda f: torch.save(state, f))


def write_json(path: Path, obj: dict[str, Any]) -> None:
    """``obj`` as indented JSON, written atomically."""
    text = (json.dumps(obj, indent=2) + "\n").encode("utf-8")
    write_atomic(Path(path), lambda f: f.write(text))


def read_metrics(run_dir: Path, event: str | None = None) -> list[dict[str, Any]]:
    with open(Path(run_dir) / "metrics.jsonl", encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [r for r in records if event is None or r.get("event") == event]

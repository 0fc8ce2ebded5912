"""Checkpoint files: atomic, checksummed, the newest K kept, loaded with ``weights_only=True``.

A checkpoint is two files in one directory (``RUN_DIR/checkpoints`` for
``omnilearn train``)::

    step-000000500.pt     torch.save of a dict of tensors and plain values
    step-000000500.json   {"format", "step", "sha256", "bytes", "saved_at", "meta"}

Each is written to a temporary file, fsynced and renamed into place, the
``.pt`` first: a checkpoint without its ``.json`` was cut short and is not
one. :meth:`CheckpointStore.load_latest` verifies the checksum of the newest
and, if it is damaged or unreadable, warns and falls back to the one before.
Only plain values and tensors are stored, so ``torch.load(...,
weights_only=True)`` reads them: a checkpoint cannot run code when loaded.

Which state goes in is the caller's: :meth:`omnilearn.bsp.session.Session.save_checkpoint`
(the session, the model, optimizer and LR scheduler) and the ASP server.

Run: ``python -m pytest -q tests/unit/test_checkpoint.py``
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from omnilearn.observe.rundir import write_atomic

FORMAT = 1
_NAME = re.compile(r"^step-(\d{9,})\.json$")


class CheckpointError(RuntimeError):
    """No usable checkpoint where one is needed, or one that does not fit this run."""


class CheckpointWarning(UserWarning):
    """A damaged checkpoint was skipped for an older one."""


class CheckpointStore:
    def __init__(self, directory: str | Path, keep: int = 3) -> None:
        if keep < 1:
            raise ValueError(f"keep={keep} must be at least 1")
        self.dir, self.keep = Path(directory), keep

    def path(self, step: int) -> Path:
        return self.dir / f"step-{step:09d}.pt"

    def steps(self) -> list[int]:
        """Steps with a complete checkpoint (its ``.json`` written), oldest first."""
        if not self.dir.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.dir.iterdir() if (m := _NAME.match(p.name)))

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any] | None = None) -> Path:
        """Write ``state`` as the checkpoint of ``step`` (replacing one of the same step); keep the newest K."""
        buffer = io.BytesIO()
        torch.save(state, buffer)
        data = buffer.getvalue()
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.path(step)
        write_atomic(path, lambda f: f.write(data))
        manifest = {"format": FORMAT, "step": int(step), "sha256": hashlib.sha256(data).hexdigest(),
                    "bytes": len(data), "saved_at": time.time(), "meta": meta or {}}
        text = (json.dumps(manifest, indent=1) + "\n").encode()
        write_atomic(path.with_suffix(".json"), lambda f: f.write(text))
        self.prune()
        return path

    def prune(self) -> None:
        """Delete all but the newest ``keep`` checkpoints (and leftovers of cut writes older than them)."""
        steps = self.steps()
        for step in steps[: max(0, len(steps) - self.keep)]:
            self.path(step).with_suffix(".json").unlink(missing_ok=True)  # the manifest first: never a .json alone
            self.path(step).unlink(missing_ok=True)

    def manifest(self, step: int) -> dict[str, Any]:
        return json.loads(self.path(step).with_suffix(".json").read_text())

    def load(self, step: int, map_location: str | torch.device = "cpu") -> dict[str, Any]:
        """The checkpoint of ``step``, its checksum verified; :class:`CheckpointError` when it is damaged."""
        try:
            manifest = self.manifest(step)
            data = self.path(step).read_bytes()
        except (OSError, ValueError) as e:
            raise CheckpointError(f"checkpoint {self.path(step)} cannot be read: {e}") from None
        if manifest.get("format") != FORMAT:
            raise CheckpointError(f"checkpoint {self.path(step)} has format {manifest.get('format')!r}; "
                                  f"this version reads {FORMAT}")
        if hashlib.sha256(data).hexdigest() != manifest.get("sha256"):
            raise CheckpointError(f"checkpoint {self.path(step)} is damaged: its checksum does not match "
                                  f"({len(data)} bytes, {manifest.get('bytes')} written)")
        try:
            return torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
        except Exception as e:  # a checksummed file that torch cannot read: another writer's, or a bug
            raise CheckpointError(f"checkpoint {self.path(step)} cannot be loaded: {e}") from None

    def load_latest(self, map_location: str | torch.device = "cpu") -> tuple[int, dict[str, Any]] | None:
        """(step, state) of the newest checkpoint that loads; damaged newer ones are skipped with a warning."""
        for step in reversed(self.steps()):
            try:
                return step, self.load(step, map_location)
            except CheckpointError as e:
                warnings.warn(f"{e}; falling back to the previous checkpoint", CheckpointWarning, stacklevel=2)
        return None

"""Checkpoint files: atomic, checksummed, the newest K kept, loaded with ``weights_only=True``.

A checkpoint is two files in one directory (``RUN_DIR/checkpoints`` for
``omnilearn train``)::

    step-000000500.pt     torch.save of a dict of tensors and plain values
    step-000000500.json   {"format", "step", "sha256", "bytes", "saved_at", "meta"}

Saving first checks that every value will load under ``weights_only=True``
(:func:`omnilearn.weightsonly.first_refused`): a numpy scalar or a ``Path``
is refused in one line naming the field (``extra['best']: numpy.float64``)
before anything is written, so the existing checkpoints stay as they were.
Each file is written to a temporary file, fsynced and renamed into place,
the ``.pt`` first: a checkpoint without its ``.json`` was cut short and is
not one. The same step saved again (an epoch-end save and a stop save; a
resumed run stopped where it started) never writes over the checkpoint it
replaces: its files take the other of two generations (``step-<n>.pt`` or
``step-<n>.g1.pt``, ``step-<n>.dcp`` or ``step-<n>.g1.dcp``), the manifest
names its generation, and its atomic rename switches from the old to the
new; the old files go at the sweep. A kill anywhere in between leaves the
old checkpoint or the new one, whole. That sequence (the parts, then the commit mark, then pruning) is
:func:`omnilearn.commit.commit`, the one every door's save follows. A sharded model's shards
sit in a companion directory ``step-000000500.dcp`` (written by every rank
before the mark); it is pruned with its checkpoint and swept when its mark
never came.

Reading tells two failures apart:

- **damaged** (:class:`CheckpointDamaged`): the ``.pt`` is missing, shorter
  or longer than its manifest says, or its SHA-256 does not match; or the
  manifest is unreadable. A write that went wrong: :meth:`CheckpointStore.read_latest`
  falls back to the newest intact one, warning and setting each damaged
  newer pair aside as ``*.damaged`` (so it neither loads again nor counts
  among the K kept, and no good checkpoint is pruned for it). When every
  checkpoint is damaged it raises and moves nothing: a resume never quietly
  becomes a fresh start, now or at the next try.
- **unloadable**: the checksum matches but ``torch.load`` refuses the file
  (written before the save checks, or by another program). No fallback: one
  line naming the file and the field (:func:`omnilearn.weightsonly.refused_field`).

:meth:`CheckpointStore.read_latest` returns the verified file bytes, so a
caller can send them on (the BSP session broadcasts them in chunks) and
:meth:`CheckpointStore.decode` them once, without another copy.

Which state goes in is the caller's: :meth:`omnilearn.bsp.session.Session.save_checkpoint`
(the session, the model, optimizer and LR scheduler) and the ASP server.

Why one file over 300 lines: the store's writing (save, generations, prune, sweep) and reading (verify, fall back,
decode) share one layout of names and one notion of a complete checkpoint; split, each half would re-derive it.

Run: ``python -m pytest -q tests/unit/test_checkpoint.py``
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import re
import shutil
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from omnilearn.commit import CheckpointWarning, claimed, commit, held
from omnilearn.observe.rundir import write_atomic
from omnilearn.weightsonly import FIX, first_refused, refused_field, refused_global

FORMAT = 1
_NAME = re.compile(r"^step-(\d{9,})\.json$")
_PT = re.compile(r"^step-(\d{9,})(?:\.g(\d+))?\.pt$")
_COMPANION = re.compile(r"^step-(\d{9,})(?:\.g(\d+))?\.(?!pt$|json$)[a-z0-9]+$")  # a directory of a checkpoint's parts
DAMAGED = ".damaged"  # suffix of a damaged checkpoint's files, set aside


def step_of(path: str | Path) -> tuple[int, int]:
    """(step, generation) of a checkpoint's ``.pt`` path."""
    m = _PT.match(Path(path).name)
    if m is None:
        raise ValueError(f"{path} is not a checkpoint's .pt (step-<n>.pt or step-<n>.g<k>.pt)")
    return int(m.group(1)), int(m.group(2) or 0)


class CheckpointError(RuntimeError):
    """No usable checkpoint where one is needed, one that does not load, or a state that would not load."""


class CheckpointDamaged(CheckpointError):
    """A checkpoint whose files do not match its manifest (a write that went wrong): an older one may be used."""


class BufferFile(io.RawIOBase):
    """A read-only, seekable file over ``data`` without copying it (``io.BytesIO`` copies anything but bytes)."""

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        super().__init__()
        self.data, self.pos = memoryview(data).cast("B"), 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: len(self.data)}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, buffer) -> int:
        n = max(0, min(len(buffer), len(self.data) - self.pos))
        memoryview(buffer).cast("B")[:n] = self.data[self.pos : self.pos + n]
        self.pos += n
        return n


class CheckpointStore:
    def __init__(self, directory: str | Path, keep: int = 3) -> None:
        if keep < 1:
            raise ValueError(f"keep={keep} must be at least 1")
        self.dir, self.keep = Path(directory), keep

    def path(self, step: int, generation: int = 0) -> Path:
        """The ``.pt`` of ``step`` in ``generation`` (0: ``step-<n>.pt``; the manifest is ``step-<n>.json``)."""
        return self.dir / (f"step-{step:09d}.g{generation}.pt" if generation else f"step-{step:09d}.pt")

    def mark(self, step: int) -> Path:
        """The manifest of ``step``: the checkpoint counts once it is there."""
        return self.dir / f"step-{step:09d}.json"

    def generation(self, step: int) -> int:
        """The generation the complete checkpoint of ``step`` is in (0 when there is none, or it cannot be read)."""
        try:
            return int(self.manifest(step).get("generation", 0))
        except (OSError, ValueError, TypeError, AttributeError):
            return 0

    def next_generation(self, step: int) -> int:
        """Where a save of ``step`` writes: the generation the complete checkpoint of ``step`` is not in."""
        return 1 - self.generation(step) if self.mark(step).exists() else 0

    def data_path(self, step: int) -> Path:
        """The ``.pt`` the manifest of ``step`` names."""
        return self.path(step, self.generation(step))

    def steps(self) -> list[int]:
        """Steps with a complete checkpoint (its ``.json`` written), oldest first."""
        if not self.dir.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.dir.iterdir() if (m := _NAME.match(p.name)))

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any] | None = None, prune: bool = True,
             after_parts: Callable[[], object] | None = None, generation: int | None = None,
             claim: bool = True) -> Path:
        """Write ``state`` as the checkpoint of ``step`` (replacing one of the same step, whose files stay until the
        new manifest is in place); keep the newest K. ``generation``: where the parts go (default
        :meth:`next_generation`; a sharded save wrote its shards there already). ``claim``: take the step's claim
        first (waiting while a survivor's :meth:`save_once` of the same step holds it: their writes would
        interleave); :meth:`save_once` holds it already.

        A value ``torch.load(weights_only=True)`` would refuse is a :class:`CheckpointError` before anything is written.
        The sequence is :func:`commit`'s: the ``.pt``, then its manifest (the mark), then :meth:`prune` (not with
        ``prune=False``: another writer may be mid-save in the directory).
        """
        refused = first_refused(state)
        if refused is not None:
            raise CheckpointError(f"checkpoint at step {step} was not written: {refused} would not load back "
                                  f"(torch.load weights_only=True); {FIX}")
        buffer = io.BytesIO()
        torch.save(state, buffer)
        data = buffer.getbuffer()
        self.dir.mkdir(parents=True, exist_ok=True)
        with held(self._claim(step)) if claim else contextlib.nullcontext():
            return self._write(step, data, meta, prune, after_parts, generation)

    def _write(self, step: int, data: memoryview, meta: dict[str, Any] | None, prune: bool,
               after_parts: Callable[[], object] | None, generation: int | None) -> Path:
        """:meth:`save`'s files, the step's claim held: the ``.pt`` of ``data``, its manifest, the prune."""
        generation = self.next_generation(step) if generation is None else generation
        path = self.path(step, generation)

        def manifest() -> bytes:
            return (json.dumps({"format": FORMAT, "step": int(step), "sha256": hashlib.sha256(data).hexdigest(),
                                "bytes": len(data), "saved_at": time.time(), "meta": meta or {},
                                **({"generation": generation} if generation else {})}, indent=1) + "\n").encode()

        def parts() -> None:
            write_atomic(path, lambda f: f.write(data))
            if after_parts is not None:  # fault injection (tests): between the .pt and its mark
                after_parts()

        commit(self.mark(step), parts, manifest, self.prune if prune else None)
        return path

    def save_once(self, step: int, state: dict[str, Any], meta: dict[str, Any] | None = None,
                  after_parts: Callable[[], object] | None = None) -> Path | None:
        """A survivor's save after a lost peer: the checkpoint of ``step``, unless one is complete already or another
        process claimed it (then None). Survivors cannot talk to each other, so the claim, ``.step-<n>.claim``
        created with ``O_EXCL``, makes one of them the writer of a step; it goes once the checkpoint is complete.
        Nothing is pruned or swept (another survivor may be writing another step here): the next ordinary save
        does it, claims left by a writer killed mid-save included (its ``.pt`` without a manifest never counts)."""
        if step in self.steps():
            return None
        self.dir.mkdir(parents=True, exist_ok=True)
        with claimed(self._claim(step)) as mine:
            return self.save(step, state, meta, prune=False, after_parts=after_parts, claim=False) if mine else None

    def _claim(self, step: int) -> Path:
        """The claim of ``step``'s one writer (:func:`omnilearn.commit.claimed`)."""
        return self.dir / f".step-{step:09d}.claim"

    def prune(self) -> None:
        """Delete all but the newest ``keep`` checkpoints (their companion directories too), and what cut writes
        left (called after a save)."""
        steps = self.steps()
        for step in steps[: max(0, len(steps) - self.keep)]:
            data = self.data_path(step)
            self.mark(step).unlink(missing_ok=True)  # the manifest first: never a .json alone
            data.unlink(missing_ok=True)
            for part in self.companions(step):
                shutil.rmtree(part, ignore_errors=True)
        self.sweep()

    def companions(self, step: int | None = None) -> list[Path]:
        """The directories beside the files that belong to a checkpoint (``step-<n>.dcp``: a sharded model's
        shards, written by every rank before the mark; ``step-<n>.g1.dcp`` in the other generation); of ``step``
        (either generation), or all."""
        if not self.dir.is_dir():
            return []
        return [p for p in self.dir.iterdir() if (m := _COMPANION.match(p.name)) and p.is_dir()
                and (step is None or int(m.group(1)) == step)]

    def sweep(self) -> None:
        """Remove the leftovers of writes cut short (a process killed mid-save): temp files, and ``.pt`` files and
        companion directories whose manifest was never written. Only the one writer calls it, after its own save
        completed."""
        generations = {step: self.generation(step) for step in self.steps()}
        kept = {self.path(step, g).name for step, g in generations.items()}
        for p in self.dir.iterdir():
            cut_pt = _PT.match(p.name) is not None and p.name not in kept
            if cut_pt or (p.name.startswith(".step-") and p.name.endswith((".tmp", ".claim"))):
                p.unlink(missing_ok=True)
        for part in self.companions():
            m = _COMPANION.match(part.name)
            if generations.get(int(m.group(1))) != int(m.group(2) or 0):  # cut short, or the generation replaced
                shutil.rmtree(part, ignore_errors=True)

    def manifest(self, step: int) -> dict[str, Any]:
        return json.loads(self.mark(step).read_text())

    def read(self, step: int) -> bytearray:
        """The ``.pt`` bytes of ``step``, checked against its manifest; :class:`CheckpointDamaged` when they differ."""
        path = self.path(step)
        try:
            manifest = self.manifest(step)
        except (OSError, ValueError) as e:
            raise CheckpointDamaged(f"checkpoint {path} is damaged: its manifest cannot be read ({e})") from None
        path = self.path(step, int(manifest.get("generation", 0)))
        if manifest.get("format") != FORMAT:
            raise CheckpointError(f"checkpoint {path} has format {manifest.get('format')!r}; this version reads "
                                  f"{FORMAT}: resume with the version that wrote it")
        try:
            with open(path, "rb") as f:
                size = f.seek(0, io.SEEK_END)
                if size != manifest.get("bytes"):
                    raise CheckpointDamaged(f"checkpoint {path} is damaged: {size} bytes, {manifest.get('bytes')} "
                                            "written (cut short)")
                f.seek(0)
                data = bytearray(size)
                f.readinto(data)
        except OSError as e:
            raise CheckpointDamaged(f"checkpoint {path} is damaged: it cannot be read ({e})") from None
        if hashlib.sha256(data).hexdigest() != manifest.get("sha256"):
            raise CheckpointDamaged(f"checkpoint {path} is damaged: its checksum does not match ({size} bytes)")
        return data

    @staticmethod
    def decode(data: bytes | bytearray, path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
        """Deserialise verified bytes of ``path`` (``weights_only=True``, no copy); a refusal names the field."""
        try:
            return torch.load(BufferFile(data), map_location=map_location, weights_only=True)
        except Exception as e:  # a checksummed file that torch refuses: written before the checks, or elsewhere
            name = refused_global(str(e))
            if name is None:
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                raise CheckpointError(f"checkpoint {path} passed its checksum but cannot be loaded: {first}") from None
            field = refused_field(data, name) or "a field"
            raise CheckpointError(f"checkpoint {path} passed its checksum but {field} holds a {name}, which "
                                  f"torch.load(weights_only=True) refuses; register it with "
                                  f"torch.serialization.add_safe_globals if you trust the file") from None

    def load(self, step: int, map_location: str | torch.device = "cpu") -> dict[str, Any]:
        """The checkpoint of ``step``: :class:`CheckpointDamaged` when damaged, :class:`CheckpointError` when refused."""
        return self.decode(self.read(step), self.data_path(step), map_location)

    def set_aside(self, step: int) -> None:
        """Rename a damaged checkpoint's files to ``*.damaged`` (the manifest first); kept for inspection."""
        for path in [self.mark(step), self.data_path(step)]:  # both named before the manifest moves
            if path.exists():
                path.replace(path.with_name(path.name + DAMAGED))

    def read_latest(self) -> tuple[int, bytearray] | None:
        """(step, verified bytes) of the newest intact checkpoint; None when there is none at all.

        Damaged newer ones are set aside, each with a :class:`CheckpointWarning`. When all are damaged,
        :class:`CheckpointError` and nothing is moved (never None: a resume must not quietly start over).
        """
        damaged: list[tuple[int, str]] = []
        for step in reversed(self.steps()):
            try:
                data = self.read(step)
            except CheckpointDamaged as e:
                damaged.append((step, str(e)))
                continue
            for bad, why in damaged:
                self._fall_back(bad, why, step)
            return step, data
        if damaged:
            raise CheckpointError(f"no usable checkpoint in {self.dir}: all {len(damaged)} are damaged (newest: "
                                  f"{damaged[0][1]}); restore a good copy, or start a new run elsewhere")
        return None

    def _fall_back(self, step: int, why: str, to: int) -> None:
        try:
            name = self.data_path(step).name
            self.set_aside(step)
            kept = f"set aside as {name}{DAMAGED}"
        except OSError as e:
            kept = f"left in place ({e.strerror})"
        warnings.warn(f"{why}; {kept}, falling back to the checkpoint of step {to}", CheckpointWarning, stacklevel=3)

    def load_latest(self, map_location: str | torch.device = "cpu") -> tuple[int, dict[str, Any]] | None:
        """(step, state) of the newest intact checkpoint (see :meth:`read_latest`); None when there is none."""
        found = self.read_latest()
        if found is None:
            return None
        step, data = found
        return step, self.decode(data, self.data_path(step), map_location)

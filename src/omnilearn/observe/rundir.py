"""Run directory: ``config.toml``, ``metrics.jsonl``, ``summary.json``, ``model.pt``.

``metrics.jsonl`` holds one JSON object per line with an ``event`` field:
``push`` (ASP: one per applied gradient), ``decision`` (one per controller
decision), ``speeds`` (an emulated speed change), ``eval`` (test metrics) and
``resume`` (a run continued from a checkpoint). Only rank 0 writes it, through
:class:`omnilearn.observe.events.EventRecorder`. BSP's ``step`` events (one per
step per worker) are in ``steps/rank-<r>.jsonl``, each written by its rank
(:mod:`omnilearn.observe.rankrows`); runs of earlier versions have them in
``metrics.jsonl``, and readers take both. ``summary.json`` and
``model.pt`` are written atomically (temp file, fsync, rename): a crash leaves
the old file or the new one, never half of one.

Nothing half-written: a write that finds the disk full (ENOSPC), the quota
spent (EDQUOT) or the file too large (EFBIG) raises :class:`DiskFull`, one
line naming the file, about how much it needs and what is free where; the
temp file is removed and the old file kept; ``metrics.jsonl`` is cut back to
its last whole line. Reading it back is :mod:`omnilearn.observe.metrics`'s.

Why one file over 300 lines: every write into a run directory (the preparation, the metrics log, the atomic
JSON and model files) shares one failure policy (a full disk is one line, nothing half-written); the
checks live beside the writes they guard.

Run its tests: ``python -m pytest -q tests/unit/test_rundir.py tests/unit/test_recorder.py``
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, BinaryIO, Callable

from omnilearn.observe import heldrun

RUN_FILES = ("config.toml", "metrics.jsonl", "summary.json", "model.pt")
STEPS_DIR = "steps"  # BSP: each rank's step rows, steps/rank-<r>.jsonl (omnilearn.observe.rankrows)
FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
FLUSH_BYTES = 1 << 20  # metrics lines held before they are written even without a flush()
TAIL_BYTES = 1 << 20  # how far back from its end metrics.jsonl is searched for a cut last line


class RunDirError(ValueError):
    """The output directory cannot be used as asked."""


class DiskFull(RunDirError):
    """A write ran out of space, quota or file size; the message names the file, the size and the fix."""


def default_out() -> Path:
    base = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    out, k = base, 1
    while out.exists():
        out, k = Path(f"{base}-{k}"), k + 1
    return out


# ---------------------------------------------------------------- full disks
def full_disk_error(exc: BaseException | None) -> OSError | None:
    """The ENOSPC/EDQUOT/EFBIG ``OSError`` behind ``exc``: itself or one it was raised from (torch.save wraps it)."""
    for _ in range(8):
        if exc is None:
            return None
        if isinstance(exc, OSError) and exc.errno in FULL_ERRNOS:
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def size_text(n: float) -> str:
    """Bytes for people: ``512 bytes``, ``12.3 kB``, ``0.3 MB``, ``4.1 GB`` (decimal units)."""
    for unit, scale, floor in (("GB", 1e9, 1e9), ("MB", 1e6, 1e5), ("kB", 1e3, 1e3)):
        if n >= floor:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} bytes"


def existing_parent(path: Path) -> Path:
    """``path`` made absolute, or its nearest ancestor that exists."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def filesystem(path: Path) -> str:
    """The filesystem holding ``path``, for messages: ``/dev/sda1 (/work)`` (its device and mount point)."""
    real, best, device = os.path.realpath(existing_parent(path)), "", None
    try:
        table = Path("/proc/self/mountinfo").read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        table = []
    for line in table:
        left, _, right = line.partition(" - ")
        fields, source = left.split(), right.split()
        point = fields[4].replace("\\040", " ") if len(fields) > 4 else ""
        if point and (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, device = point, source[1] if len(source) > 1 else None
    return f"{device} ({best})" if device and best else best or real


def disk_full(path: Path, error: OSError, needed: int | None, at_least: bool = False) -> DiskFull:
    """The one-line :class:`DiskFull` for ``error`` while writing ``needed`` bytes (or more) to ``path``."""
    try:
        have = f"{size_text(shutil.disk_usage(existing_parent(path)).free)} free on {filesystem(path)}"
    except OSError:
        have = f"free space on {filesystem(path)} unknown"
    need = "an unknown amount" if needed is None else f"{'more than' if at_least else 'about'} {size_text(needed)}"
    if error.errno == errno.EDQUOT:
        return DiskFull(f"disk quota exceeded writing {path}: it needs {need}, {have} but your quota there is "
                        "spent; free some of your files or choose another --out")
    if error.errno == errno.EFBIG:
        return DiskFull(f"file too large writing {path}: it needs {need}, more than one file may hold there "
                        f"(filesystem limit or `ulimit -f`; {have}); choose another --out or raise the limit")
    return DiskFull(f"no space left on device writing {path}: it needs {need}, {have}; "
                    "free some space or choose another --out")


class _Counter:
    """A write-only sink that counts bytes: how much a writer produces, nothing kept."""

    def __init__(self) -> None:
        self.size = 0

    def write(self, data) -> int:
        n = memoryview(data).nbytes
        self.size += n
        return n

    def flush(self) -> None:
        pass


def _needed(write: Callable[[BinaryIO], None], tmp: Path) -> tuple[int | None, bool]:
    """(bytes ``write`` produces, False), from a dry run into a counter; else (bytes it got on disk, True)."""
    counter = _Counter()
    try:
        write(counter)  # type: ignore[arg-type]
        return counter.size, False
    except Exception:  # a writer that needs a real file: what reached the disk is a lower bound
        try:
            return os.path.getsize(tmp), True
        except OSError:
            return None, False


# ---------------------------------------------------------------- writing
def check_out(out: str | None, overwrite: bool) -> Path:
    """The run directory ``out`` names (a new ``runs/<time>`` for None), refused if it is a file or holds a run."""
    path = default_out() if out is None else Path(out)
    if path.exists() and not path.is_dir():
        raise RunDirError(f"--out {str(path)!r} is a file, not a directory; choose another --out")
    previous = [f for f in RUN_FILES if (path / f).exists()]
    if previous and not overwrite:
        raise RunDirError(
            f"--out {str(path)!r} already holds a run ({', '.join(previous)}); "
            "choose another --out or pass --overwrite"
        )
    return path


def record_items(path: Path) -> list[str]:
    """The names of the run ``path`` holds: its files, error logs and the ranks' step rows."""
    return [*(f for f in RUN_FILES if (path / f).exists()), *(p.name for p in path.glob("error-rank*.log")),
            *([STEPS_DIR] if (path / STEPS_DIR).is_dir() else [])]


def clear_run(path: Path) -> None:
    """Remove the run ``path`` holds (``--overwrite``): its files, error logs and the ranks' step rows."""
    for name in record_items(path):
        if (path / name).is_dir():
            shutil.rmtree(path / name)
        else:
            (path / name).unlink()


def prepare(out: str | None, overwrite: bool, config_toml: str, keep: bool = False, hold: bool = False) -> Path:
    """Check and create the run directory, then write ``config.toml`` into it (:class:`DiskFull` when full).
    ``keep``: the same job again (a torchrun restart of it): its record goes on in the directory, whatever
    ``overwrite`` says (``overwrite`` replaces an earlier run, not the one restarting). ``hold``: a script that may
    resume it (``omnilearn.setup``): the record ``overwrite`` replaces is held until the run resumes it or trains
    without it (:mod:`omnilearn.observe.heldrun`)."""
    path = check_out(out, overwrite or keep)
    data = config_toml.encode("utf-8")
    try:
        path.mkdir(parents=True, exist_ok=True)
        if not keep and hold:
            heldrun.hold(path, [n for n in record_items(path) if n != "config.toml"])
        elif not keep:
            clear_run(path)
        write_atomic(path / "config.toml", lambda f: f.write(data))
    except OSError as e:
        full = full_disk_error(e)
        if full is not None:
            raise disk_full(path / "config.toml", full, len(data)) from None
        raise RunDirError(f"cannot use --out {str(path)!r}: {e.strerror}") from None
    return path


def _cut_tail(path: Path) -> tuple[int, bytes] | None:
    """(size up to the last newline, the bytes after it) when ``path`` does not end in one (a record < 1 MB)."""
    with open(path, "rb") as f:
        start = max(0, f.seek(0, os.SEEK_END) - TAIL_BYTES)
        f.seek(start)
        tail = f.read()
    if not tail or tail.endswith(b"\n"):
        return None
    k = tail.rfind(b"\n") + 1
    return start + k, tail[k:]


class MetricsLog:
    """Appends JSON lines to ``metrics.jsonl`` (rank 0), or to a rank's ``steps/rank-<r>.jsonl``: whole lines, or none.

    Lines are held until :meth:`flush` (or ``FLUSH_BYTES`` of them) and then
    written in one go; a write that fails is cut back to the file's last whole
    line and its lines are dropped (a full disk raises :class:`DiskFull`). A
    file that ends in a line cut by a crash (a run being resumed) has that
    line removed, with a warning, before anything is appended.
    """

    def __init__(self, run_dir: Path, name: str = "metrics.jsonl") -> None:
        self.path = Path(run_dir) / name
        self.lines: list[str] = []
        self.held = 0
        self.fd: int | None = None
        try:
            self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
            self._mend()
        except OSError as e:
            self.close()
            full = full_disk_error(e)
            if full is None:
                raise
            raise disk_full(self.path, full, None) from None

    def _mend(self) -> None:
        tail = _cut_tail(self.path)
        if tail is None:
            return
        keep, rest = tail
        try:
            whole = isinstance(json.loads(rest), dict)
        except ValueError:
            whole = False
        if whole:  # a complete record lacking only its newline
            os.write(self.fd, b"\n")
            return
        os.ftruncate(self.fd, keep)
        print(f"omnilearn: warning: {self.path} ended in a line cut by a crash ({len(rest)} bytes); "
              "removed it before appending", file=sys.stderr)

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, separators=(",", ":")) + "\n"
        self.lines.append(line)
        self.held += len(line)
        if self.held >= FLUSH_BYTES:
            self.flush()

    def flush(self) -> None:
        if not self.lines or self.fd is None:
            return
        data = "".join(self.lines).encode("utf-8")
        self.lines, self.held = [], 0
        start = os.fstat(self.fd).st_size
        try:
            view = memoryview(data)
            while view:
                n = os.write(self.fd, view)
                if n <= 0:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
                view = view[n:]
        except OSError as e:
            try:
                os.ftruncate(self.fd, start)  # whole lines only; shrinking needs no space
            except OSError:
                pass
            full = full_disk_error(e)
            if full is None:
                raise
            raise disk_full(self.path, full, len(data)) from None

    def close(self) -> None:
        try:
            self.flush()
        finally:
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None

    def __del__(self) -> None:  # an owner that never closed: write what is held, as a buffered file would
        try:
            self.close()
        except Exception:
            pass


def sync(directory: Path) -> None:
    """fsync a directory (so a rename in it survives a crash) or a file, where the platform allows it."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Write ``path`` through ``write(file)`` into a temp file beside it, fsync it, then rename it over ``path``.

    On a full disk: :class:`DiskFull` naming the size ``write`` produces (found by running it again into a
    counter); the temp file is removed and an old ``path`` is left as it was.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        try:
            with open(tmp, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except Exception as e:
            full = full_disk_error(e)
            if full is None:
                raise
            raise disk_full(path, full, *_needed(write, tmp)) from None
    finally:
        tmp.unlink(missing_ok=True)
    sync(path.parent)


def write_json(path: Path, obj: dict[str, Any]) -> None:
    """``obj`` as indented JSON, written atomically."""
    text = (json.dumps(obj, indent=2) + "\n").encode("utf-8")
    write_atomic(Path(path), lambda f: f.write(text))

"""Run directory: ``config.toml``, ``metrics.jsonl``, ``summary.json``, ``model.pt``.

``metrics.jsonl`` holds one JSON object per line with an ``event`` field:
``step`` (BSP: one per step per worker), ``push`` (ASP: one per applied
gradient), ``decision`` (one per controller decision), ``speeds`` (an
emulated speed change), ``eval`` (test metrics) and ``resume`` (a run continued
from a checkpoint). Only rank 0 writes, through
:class:`omnilearn.observe.events.EventRecorder`. ``summary.json`` and
``model.pt`` are written atomically (temp file, fsync, rename): a crash leaves
the old file or the new one, never half of one.

Nothing half-written: a write that finds the disk full (ENOSPC), the quota
spent (EDQUOT) or the file too large (EFBIG) raises :class:`DiskFull`, one
line naming the file, about how much it needs and what is free where; the
temp file is removed and the old file kept; ``metrics.jsonl`` is cut back to
its last whole line. Reading (:func:`read_metrics`, and the report through
:func:`parse_jsonl` and :func:`replay`) accepts a last line cut by a crash
(one warning) and keeps, of a resumed run, only what the resumed run did not
redo.

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
from typing import Any, BinaryIO, Callable, Iterable

RUN_FILES = ("config.toml", "metrics.jsonl", "summary.json", "model.pt")
FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
FLUSH_BYTES = 1 << 20  # metrics lines held before they are written even without a flush()
TAIL_BYTES = 1 << 20  # how far back from its end metrics.jsonl is searched for a cut last line
_warned: set[tuple[str, int]] = set()  # (file, line) of cut lines already warned about


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


def prepare(out: str | None, overwrite: bool, config_toml: str) -> Path:
    """Check and create the run directory, then write ``config.toml`` into it (:class:`DiskFull` when full)."""
    path = check_out(out, overwrite)
    data = config_toml.encode("utf-8")
    try:
        path.mkdir(parents=True, exist_ok=True)
        for f in [*(f for f in RUN_FILES if (path / f).exists()), *(p.name for p in path.glob("error-rank*.log"))]:
            (path / f).unlink()
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
    """Appends JSON lines to ``metrics.jsonl`` (rank 0 only): whole lines, or none.

    Lines are held until :meth:`flush` (or ``FLUSH_BYTES`` of them) and then
    written in one go; a write that fails is cut back to the file's last whole
    line and its lines are dropped (a full disk raises :class:`DiskFull`). A
    file that ends in a line cut by a crash (a run being resumed) has that
    line removed, with a warning, before anything is appended.
    """

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
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


def _sync_dir(directory: Path) -> None:
    """fsync ``directory`` so a rename in it survives a crash (not possible everywhere)."""
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
    _sync_dir(path.parent)


def save_model(run_dir: Path, model) -> None:
    """``RUN_DIR/model.pt``: the model's ``state_dict`` as CPU tensors (``torch.load(..., weights_only=True)``)."""
    import torch

    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    write_atomic(Path(run_dir) / "model.pt", lambda f: torch.save(state, f))


def write_json(path: Path, obj: dict[str, Any]) -> None:
    """``obj`` as indented JSON, written atomically."""
    text = (json.dumps(obj, indent=2) + "\n").encode("utf-8")
    write_atomic(Path(path), lambda f: f.write(text))


# ---------------------------------------------------------------- reading
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


def read_metrics(run_dir: Path, event: str | None = None) -> list[dict[str, Any]]:
    """``RUN_DIR/metrics.jsonl`` as the run stands (:func:`parse_jsonl`, then :func:`replay`), of one ``event``."""
    records = replay(parse_jsonl(Path(run_dir) / "metrics.jsonl"))
    return [r for r in records if event is None or r.get("event") == event]

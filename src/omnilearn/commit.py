"""The one save sequence every front door follows: a checkpoint is complete or absent.

    commit(mark, write_parts, mark_bytes, prune)

1. ``write_parts()`` writes every part of the checkpoint (each atomically, by the caller);
2. the commit mark comes last: temp file, fsync, rename, directory fsync. A reader counts a checkpoint only by
   its mark, so a kill anywhere before leaves the previous checkpoint as the newest complete one;
3. only then ``prune()`` rotates older checkpoints away: nothing is removed before the new one is whole.

Who uses it: :class:`omnilearn.checkpoint.CheckpointStore` (the API, ``omnilearn train``, FSDP2's DCP shards as
a part), ``OmniLearnTrainer`` (Trainer's folder as the parts, ``omnilearn_session.pt`` as the mark, Trainer's
``save_total_limit`` rotation as the prune) and the TensorFlow runtime (``omnilearn.tf.checkpointing``).
Lightning's checkpoint is one file Lightning writes, with the session state inside it.

A checkpoint that is a directory (the TensorFlow runtime's ``step-N/``) is committed by a rename:

    commit_directory(final, write_parts, mark_name, mark_bytes, prune)

the parts into ``.NAME.tmp-<pid>/`` beside ``final``, each file fsynced, the mark last inside it by
:func:`commit`; then the swap: an old ``final`` (the same step saved again) moved aside to
``.NAME.old-<pid>``, the new directory renamed in, the parent fsynced, the aside removed; then ``prune()``.
A kill between leaves an aside: :func:`committed_directories` counts it as that name's checkpoint, and
:func:`recover_directories` (the first thing every ``commit_directory`` does) puts it back, and sweeps the
temporary directories of saves that never committed.

No torch here (the TensorFlow runtime uses it too).

Run: ``python -m pytest -q tests/unit/test_commit.py tests/unit/test_checkpoint.py -k commit``
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from omnilearn.observe.rundir import sync, write_atomic


class CheckpointWarning(UserWarning):
    """A damaged checkpoint was set aside for an older one, or older ones could not be pruned."""


def commit(mark: Path, write_parts: Callable[[], object], mark_bytes: Callable[[], bytes],
           prune: Callable[[], object] | None = None) -> Path:
    """The one save sequence for every door: complete or absent, nothing rotated away before the new one is whole.

    1. ``write_parts()``: every part of the checkpoint (each written atomically by the caller; a failure raises
       here and nothing below runs: no mark, nothing pruned);
    2. the commit mark, last: ``mark_bytes()`` (called after the parts: it may hold their checksums) written to a
       temporary file beside ``mark``, fsynced, renamed over ``mark``, the directory fsynced
       (:func:`~omnilearn.observe.rundir.write_atomic`). A reader counts a checkpoint only by its mark;
    3. ``prune()``: rotate older checkpoints away, only now. A prune that fails (an ``OSError``) leaves the new
       checkpoint complete: a :class:`CheckpointWarning`, not an error (the next save prunes again).

    Returns ``mark``.
    """
    write_parts()
    data = mark_bytes()
    write_atomic(Path(mark), lambda f: f.write(data))
    _prune(mark, prune)
    return Path(mark)


@contextmanager
def claimed(claim: Path) -> Iterator[bool]:
    """One writer among processes that cannot talk (survivors of a lost peer): True when this process created
    ``claim`` (``O_EXCL``), False when another holds it. Ours goes when the block ends. The claim names its writer
    (host, pid, start time): one left by a writer that died (killed mid-save) on this host is stale, and is
    taken over (renamed away first, so of two survivors finding it only one does), else a later failure at the
    same step would save nothing. A writer on another host cannot be checked: its claim holds."""
    claim = Path(claim)
    for _ in range(2):  # a stale claim: once more after taking it away
        try:
            fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            if not stale(claim):
                yield False
                return
            try:
                os.replace(claim, claim.with_name(f"{claim.name}.stale-{os.getpid()}"))
            except FileNotFoundError:  # another survivor took it away first: try to create it like it
                pass
            else:
                claim.with_name(f"{claim.name}.stale-{os.getpid()}").unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(writer_line())
        break
    else:
        yield False
        return
    try:
        yield True
    finally:
        claim.unlink(missing_ok=True)


@contextmanager
def held(claim: Path, wait_s: float = 60.0, poll_s: float = 0.05) -> Iterator[None]:
    """:func:`claimed` for a writer that must write (an ordinary save): while another holds the claim (a survivor
    saving the same checkpoint: the two writes would interleave), wait for it, up to ``wait_s``; then
    ``TimeoutError`` naming the claim (nothing written)."""
    deadline = time.monotonic() + wait_s
    while True:
        with claimed(claim) as mine:
            if mine:
                yield
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{claim} is held by another writer of the same checkpoint (a survivor's save) "
                               f"after {wait_s:g} s; nothing was written")
        time.sleep(poll_s)


def start_time(pid: int) -> str | None:
    """A process's start time (clock ticks since boot, ``/proc``), None when it is gone or not readable."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def writer_line() -> str:
    """``host pid start-time``: who writes a claim (or owns a directory), as :func:`stale` reads it."""
    return f"{socket.gethostname()} {os.getpid()} {start_time(os.getpid()) or '-'}\n"


def stale(claim: Path) -> bool:
    """Whether ``claim`` was left by a writer that is gone: on this host, its pid no longer runs, or another process
    (a later start time) has that pid now. A claim that names no writer (an older version's) counts as live."""
    try:
        host, pid, started = Path(claim).read_text().split()
    except (OSError, ValueError):
        return False
    if host != socket.gethostname() or not pid.isdigit():
        return False
    now = start_time(int(pid))
    return now is None or (started != "-" and now != started)


def sweep_claims(directory: Path) -> None:
    """Remove the stale claims in ``directory`` (``.<name>.claim`` files whose writer is gone): an ordinary save's
    tidying, at every door."""
    directory = Path(directory)
    if not directory.is_dir():
        return
    for p in directory.iterdir():
        if p.name.startswith(".") and p.name.endswith(".claim") and stale(p):
            p.unlink(missing_ok=True)


def _prune(done: Path, prune: Callable[[], object] | None) -> None:
    """``prune()`` once ``done`` is committed; an ``OSError`` is a :class:`CheckpointWarning` (see :func:`commit`)."""
    if prune is None:
        return
    try:
        prune()
    except OSError as e:
        warnings.warn(f"checkpoint {done} is complete, but removing older checkpoints failed ({e}); they stay "
                      "until a later save prunes them", CheckpointWarning, stacklevel=3)


_TMP = re.compile(r"^\.(.+)\.tmp-\d+$")  # a directory being written (a save that never committed, once swept)
_ASIDE = re.compile(r"^\.(.+)\.old-\d+$")  # a committed directory moved aside while its name is saved again


def commit_directory(final: Path, write_parts: Callable[[Path], object], mark_name: str,
                     mark_bytes: Callable[[], bytes], prune: Callable[[], object] | None = None) -> Path:
    """:func:`commit` for a checkpoint that is a directory: complete or absent under ``final``'s name.

    1. :func:`recover_directories` in ``final``'s parent (what an earlier crash left);
    2. ``write_parts(tmp)`` into a fresh ``.NAME.tmp-<pid>/`` beside ``final``; every file there is fsynced;
    3. the mark ``tmp/mark_name`` last (:func:`commit`), then ``tmp`` fsynced;
    4. the swap: an existing ``final`` is moved aside (``.NAME.old-<pid>``), ``tmp`` renamed to ``final``
       (a failed rename puts the aside back), the parent fsynced, the aside removed;
    5. ``prune()``, only now (an ``OSError`` there is a :class:`CheckpointWarning`).

    A failure before the swap removes ``tmp`` and raises: the previous checkpoint stays as it was. Returns ``final``.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    recover_directories(final.parent, mark_name)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    try:
        tmp.mkdir()
        commit(tmp / mark_name, lambda: (write_parts(tmp), sync_tree(tmp)), mark_bytes)
        sync(tmp)
        _swap(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _prune(final, prune)
    return final


def _swap(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final``; a ``final`` already there is moved aside first and removed only once the new
    one is in place."""
    aside = final.with_name(f".{final.name}.old-{os.getpid()}") if final.exists() else None
    if aside is not None:
        os.replace(final, aside)
    try:
        os.replace(tmp, final)
    except BaseException:
        if aside is not None:
            os.replace(aside, final)
        raise
    sync(final.parent)
    if aside is not None:
        shutil.rmtree(aside)


def committed_directories(parent: Path, mark_name: str) -> dict[str, Path]:
    """Each committed checkpoint directory in ``parent`` by its final name: itself, or its aside where a crash
    left only that. Committed: it holds ``mark_name``."""
    parent = Path(parent)
    if not parent.is_dir():
        return {}
    found: dict[str, Path] = {}
    for p in sorted(parent.iterdir(), key=lambda p: p.name.startswith(".")):  # asides last: a final name wins
        aside = _ASIDE.match(p.name)
        name = aside.group(1) if aside else None if p.name.startswith(".") else p.name
        if name is not None and p.is_dir() and (p / mark_name).is_file():
            found.setdefault(name, p)
    return found


def recover_directories(parent: Path, mark_name: str) -> None:
    """Mend what a crash in :func:`commit_directory` left in ``parent``: temporary directories removed; an aside
    put back where its final name holds no committed checkpoint, else removed; stale claims removed."""
    parent = Path(parent)
    if not parent.is_dir():
        return
    for p in parent.iterdir():
        if _TMP.match(p.name):
            shutil.rmtree(p, ignore_errors=True)
    sweep_claims(parent)
    for p in parent.iterdir():
        aside = _ASIDE.match(p.name)
        if aside is None:
            continue
        final = parent / aside.group(1)
        if (final / mark_name).is_file() or not (p / mark_name).is_file():
            shutil.rmtree(p, ignore_errors=True)
        else:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(p, final)
    sync(parent)


def sync_tree(directory: Path) -> None:
    """fsync every file under ``directory`` and the directories holding them (a library's writes may not be)."""
    for root, _dirs, files in os.walk(directory):
        for name in files:
            sync(Path(root) / name)
        sync(Path(root))

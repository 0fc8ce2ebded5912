"""A simulated crash for the commit tests: ``os.replace``, ``os.unlink`` and ``shutil.rmtree`` that die after the
k-th call; with ``files=True`` also the other steps of a file's save (renames, fsyncs, a copy across filesystems).

Used by ``tests/unit/test_commit.py``, ``tests/unit/test_checkpoint.py``, ``tests/tf/test_tf_commit.py`` and
(``files=True``, :func:`other_filesystem`) ``tests/dist/test_lightning_atomic.py``.
"""

from __future__ import annotations

import errno
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


class Crash(BaseException):
    """The process died here."""


class Ops:
    """While entered: ``os.replace``, ``os.unlink`` (``Path.unlink``) and ``shutil.rmtree`` that die after the
    ``crash_after``-th call (that call and every later one raise :class:`Crash`).

    ``files=True`` counts the other steps of saving a file too: ``os.rename``, ``os.remove`` and ``os.fsync`` (a
    temp file or a directory made durable: dying after it is dying once the data is written), and ``os.sendfile``
    (``shutil.move``'s copy across filesystems), whose dying call copies half of what is left: a kill mid-copy.
    """

    def __init__(self, crash_after: int, files: bool = False) -> None:
        self.calls, self.crash_after, self.dead = 0, crash_after, False
        self.replace, self.unlink, self.rmtree = os.replace, os.unlink, shutil.rmtree
        self.files = files
        self.rename, self.remove, self.fsync = os.rename, os.remove, os.fsync
        self.sendfile = getattr(os, "sendfile", None)  # Linux and macOS: shutil's copy uses it on Linux

    def __enter__(self) -> "Ops":
        os.replace = lambda *a, **k: self.do(self.replace, *a, **k)
        os.unlink = lambda *a, **k: self.do(self.unlink, *a, **k)
        shutil.rmtree = lambda *a, **k: self.do(self.rmtree, *a, **k)
        if self.files:
            os.rename = lambda *a, **k: self.do(self.rename, *a, **k)
            os.remove = lambda *a, **k: self.do(self.remove, *a, **k)
            os.fsync = lambda *a, **k: self.do(self.fsync, *a, **k)
            if self.sendfile is not None:
                os.sendfile = self.copy
        return self

    def __exit__(self, *_exc) -> None:
        os.replace, os.unlink, shutil.rmtree = self.replace, self.unlink, self.rmtree
        if self.files:
            os.rename, os.remove, os.fsync = self.rename, self.remove, self.fsync
            if self.sendfile is not None:
                os.sendfile = self.sendfile

    def do(self, op, *args, **kwargs):
        if self.dead:
            raise Crash()
        result = op(*args, **kwargs)
        self.calls += 1
        if self.calls > self.crash_after:
            self.dead = True
            raise Crash()
        return result

    def copy(self, out_fd: int, in_fd: int, offset: int, count: int) -> int:
        """``os.sendfile`` as ``shutil`` calls it; the dying call copies half of what is left, then dies."""
        if self.dead or self.calls + 1 <= self.crash_after:
            return self.do(self.sendfile, out_fd, in_fd, offset, count)
        self.sendfile(out_fd, in_fd, offset, max(0, min(count, os.fstat(in_fd).st_size - offset) // 2))
        self.calls, self.dead = self.calls + 1, True
        raise Crash()


@contextmanager
def other_filesystem(directory: Path) -> Iterator[None]:
    """While entered, ``directory`` is on another filesystem than the rest: a rename of a file in it to anywhere
    else fails with ``EXDEV``, as the kernel's does (``shutil.move`` then copies). Enter it before :class:`Ops`."""
    inside = os.path.realpath(directory)
    rename, replace = os.rename, os.replace

    def crossing(src, dst) -> bool:
        src_dir, dst_dir = os.path.dirname(os.path.realpath(src)), os.path.dirname(os.path.realpath(dst))
        return (src_dir == inside) != (dst_dir == inside)

    def guarded(op):
        def call(src, dst, *args, **kwargs):
            if crossing(src, dst):
                raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), str(src), None, str(dst))
            return op(src, dst, *args, **kwargs)
        return call

    os.rename, os.replace = guarded(rename), guarded(replace)
    try:
        yield
    finally:
        os.rename, os.replace = rename, replace

"""A simulated crash for the commit tests: ``os.replace``, ``os.unlink`` and ``shutil.rmtree`` that die after the
k-th call.

Used by ``tests/unit/test_commit.py``, ``tests/unit/test_checkpoint.py`` and ``tests/tf/test_tf_commit.py``.
"""

from __future__ import annotations

import os
import shutil


class Crash(BaseException):
    """The process died here."""


class Ops:
    """While entered: ``os.replace``, ``os.unlink`` (``Path.unlink``) and ``shutil.rmtree`` that die after the
    ``crash_after``-th call (that call and every later one raise :class:`Crash`)."""

    def __init__(self, crash_after: int) -> None:
        self.calls, self.crash_after, self.dead = 0, crash_after, False
        self.replace, self.unlink, self.rmtree = os.replace, os.unlink, shutil.rmtree

    def __enter__(self) -> "Ops":
        os.replace = lambda *a, **k: self.do(self.replace, *a, **k)
        os.unlink = lambda *a, **k: self.do(self.unlink, *a, **k)
        shutil.rmtree = lambda *a, **k: self.do(self.rmtree, *a, **k)
        return self

    def __exit__(self, *_exc) -> None:
        os.replace, os.unlink, shutil.rmtree = self.replace, self.unlink, self.rmtree

    def do(self, op, *args, **kwargs):
        if self.dead:
            raise Crash()
        result = op(*args, **kwargs)
        self.calls += 1
        if self.calls > self.crash_after:
            self.dead = True
            raise Crash()
        return result

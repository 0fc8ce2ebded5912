"""multiprocessing's temporary directory (``pymp-*``, where the fork server's socket lives), marked as this
launcher's, so that a later local run removes it when this launcher was SIGKILLed: multiprocessing removes it only
at a normal exit.

:func:`mark` writes ``omnilearn-owner`` (host, pid and start time, as :func:`omnilearn.commit.stale` reads them)
into this process's ``pymp-*`` directory; :func:`sweep` removes the ``pymp-*`` directories of the temp dir that hold
such a file whose writer is gone. Another program's directories (no such file) are never touched.

Run: ``python -m pytest -q tests/unit/test_netns.py``
"""

from __future__ import annotations

import shutil
import tempfile
from multiprocessing import util
from pathlib import Path

from omnilearn.commit import stale, writer_line

OWNER = "omnilearn-owner"
PREFIX = "pymp-"  # multiprocessing's, fixed in multiprocessing.util.get_temp_dir


def mark() -> None:
    """Name this process as the owner of its multiprocessing temp dir (made now if it was not yet)."""
    try:
        (Path(util.get_temp_dir()) / OWNER).write_text(writer_line())
    except OSError:
        pass  # a temp dir we cannot write: nothing to sweep later, nothing else changes


def sweep(parent: Path | None = None) -> None:
    """Remove the ``pymp-*`` directories in ``parent`` (the temp dir) whose owner file names a process gone."""
    for folder in Path(parent or tempfile.gettempdir()).glob(f"{PREFIX}*"):
        owner = folder / OWNER
        if owner.is_file() and stale(owner):
            shutil.rmtree(folder, ignore_errors=True)

"""Imported by the launcher's fork server only (:data:`omnilearn.experiments.launch.supervise.PRELOAD`): a quick exit.

The fork server ends as an ordinary Python process when its launcher goes, and Python's last garbage collections
would then walk every object that importing torch and ``torch._dynamo`` made: about a second of CPU, after every
launch, spent on memory the kernel frees anyway. At exit the objects alive then are frozen out of those
collections (``gc.freeze``); the server holds nothing that needs a finalizer (no file, no run state). Its ranks
leave with ``os._exit`` and never run this. The command line's own process does the same (:func:`freeze`, from
``omnilearn.experiments.cli.entry``).

Not where a nanobind extension is loaded (triton, which ``torch._dynamo`` imports on torch's CUDA builds): nanobind
counts the objects still alive at exit and prints "nanobind: leaked N instances!" for each one the final
collections did not free, which frozen objects never are (seen on torch 2.15.0+cu132 with triton 3.9: a page of
stderr after every command). There the process pays the second instead.

Run: ``python -m pytest -q tests/unit/test_launch_store.py``
"""

from __future__ import annotations

import atexit
import gc
import sys

NANOBIND_MODULES = ("triton",)  # loaded extensions that report the objects alive at exit as leaks


def freeze() -> None:
    """Leave the objects alive now out of the exit's garbage collections, unless a nanobind extension is loaded."""
    if not any(name in sys.modules for name in NANOBIND_MODULES):
        gc.freeze()


atexit.register(freeze)

"""Imported by the launcher's fork server only (:data:`omnilearn.experiments.launch.supervise.PRELOAD`): a quick exit.

The fork server ends as an ordinary Python process when its launcher goes, and Python's last garbage collections
would then walk every object that importing torch and ``torch._dynamo`` made: about a second of CPU, after every
launch, spent on memory the kernel frees anyway. At exit the objects alive then are frozen out of those
collections (``gc.freeze``); the server holds nothing that needs a finalizer (no file, no run state). Its ranks
leave with ``os._exit`` and never run this.

Run: ``python -m pytest -q tests/unit/test_launch_store.py``
"""

from __future__ import annotations

import atexit
import gc

atexit.register(gc.freeze)

"""``needs("tensorflow", "tensorflow")``: skip a test module where an extra is missing, without importing it.

pytest-xdist's workers each collect every test file, so a module-level ``pytest.importorskip("tensorflow")`` made
every worker import TensorFlow (about 3 s of CPU) or transformers (about 2 s) whether or not it ran one of their
tests. A module marked with this imports them in its tests, where they run.
"""

from __future__ import annotations

import importlib.util

import pytest


def needs(module: str, extra: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(importlib.util.find_spec(module) is None, reason=f"the [{extra}] extra is not installed")

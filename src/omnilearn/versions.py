"""The framework versions each front door was tested on, checked once at that door's setup.

Every integration reads or overrides private names of its framework (Trainer's ``_save_checkpoint``,
Lightning's ``_accelerator_connector``, DDP's ``reducer._reset_state``, ...). Those names change
without notice between releases, so a door accepts only the versions its tests ran on:

    from omnilearn.versions import require_tested
    require_tested("transformers", door="OmniLearnTrainer")   # ConfigError outside TESTED["transformers"]

Outside the range the door refuses in one line naming the installed version, the tested range and the
way out (install a tested version, or ``OMNILEARN_ALLOW_UNTESTED=1`` to run anyway with a warning).
The ranges are the ones the integration tests ran on (docs/versions.md lists them with the dates);
a range's upper bound is exclusive and names the first release not tested.

Pure: no torch, no framework import (the caller's package is looked up with importlib.metadata).

Run: ``python -m pytest -q tests/unit/test_versions.py``
"""

from __future__ import annotations

import os
import re
import warnings
from importlib import metadata

from omnilearn.config import ConfigError

ALLOW_ENV = "OMNILEARN_ALLOW_UNTESTED"

# distribution -> (lowest tested, first untested): lo <= version < hi. Kept in step with docs/versions.md.
TESTED: dict[str, tuple[str, str]] = {
    "torch": ("2.11", "2.14"),            # 2.13.0 CPU: the whole suite; 2.11 CUDA: tests/gpu on an H100
    "transformers": ("5.18", "5.25"),     # OmniLearnTrainer: 5.18.0, 5.20.2, 5.24.0 (5.17: its resume fails on torch 2.13)
    "accelerate": ("1.15", "1.16"),       # under OmniLearnTrainer
    "lightning": ("2.6", "2.7"),          # OmniLearnStrategy, the Fabric door: 2.6.0, 2.6.6
    "pytorch-lightning": ("2.6", "2.7"),
    "tensorflow-cpu": ("2.21", "2.22"),   # omnilearn.tf
    "tensorflow": ("2.21", "2.22"),
    "keras": ("3.15", "3.16"),
}

_RELEASE = re.compile(r"^\s*v?(\d+(?:\.\d+)*)")


def release(version: str) -> tuple[int, ...]:
    """The numeric release of ``version`` ("4.57.1" -> (4, 57, 1); "5.0.0rc1" and "2.6.0+cpu" -> (5, 0, 0), (2, 6, 0))."""
    match = _RELEASE.match(version)
    if match is None:
        raise ValueError(f"not a version: {version!r}")
    parts = tuple(int(p) for p in match.group(1).split("."))
    return parts + (0,) * (3 - len(parts)) if len(parts) < 3 else parts


def in_range(version: str, lo: str, hi: str) -> bool:
    """``lo <= version < hi`` by release numbers (a pre-release counts as its release)."""
    return release(lo) <= release(version) < release(hi)


def installed(dist: str) -> str | None:
    """The installed version of distribution ``dist``, or None."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def untested(dist: str, version: str | None, door: str) -> str | None:
    """The one-line refusal for ``version`` of ``dist`` at ``door``, or None when it is in the tested range."""
    if version is None or dist not in TESTED:
        return None
    lo, hi = TESTED[dist]
    if in_range(version, lo, hi):
        return None
    return (f"{door}: {dist} {version} is outside the versions OmniLearn was tested with ({dist}>={lo},<{hi}; "
            f"it relies on {dist}'s private names): pip install '{dist}>={lo},<{hi}', or set {ALLOW_ENV}=1 "
            "to run anyway")


def require_tested(dist: str, *, door: str) -> None:
    """Refuse (:class:`ConfigError`) an installed ``dist`` outside ``TESTED[dist]``; with ``OMNILEARN_ALLOW_UNTESTED=1``, warn."""
    problem = untested(dist, installed(dist), door)
    if problem is None:
        return
    if os.environ.get(ALLOW_ENV, "") not in ("", "0"):
        warnings.warn(problem, RuntimeWarning, stacklevel=2)
        return
    raise ConfigError(problem)

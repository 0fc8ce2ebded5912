"""The framework versions each front door was tested on, checked once at that door's setup.

Every integration reads or overrides private names of its framework (Trainer's ``_save_checkpoint``,
Lightning's ``_accelerator_connector``, DDP's ``reducer._reset_state``, ...). Those names change
without notice between releases, so a door accepts only the versions its tests ran on:

    from omnilearn.versions import require_tested
    require_tested("transformers", door="OmniLearnTrainer")   # ConfigError outside TESTED["transformers"]

Outside the range the door refuses in one line naming the installed version, the tested range and the
way out (install a tested version, or ``OMNILEARN_ALLOW_UNTESTED=1`` to run anyway with a warning); a version
that cannot be read ("", "unknown") gets that line too, never a traceback. torch is the exception
(:func:`omnilearn.torchnames.require_torch`, at every PyTorch door and the CLI): a release newer than the tested
range, or one whose version cannot be read, is checked by the private names OmniLearn uses (once per process) and
runs with a one-line warning when they hold, or is refused in one line naming the one that changed.
The ranges are the ones the integration tests ran on (docs/versions.md lists them with the dates);
a range's upper bound is exclusive and names the first release not tested.

Pure: no torch, no framework import (a package is looked up with importlib.metadata).

Run: ``python -m pytest -q tests/unit/test_versions.py``
"""

from __future__ import annotations

import os
import re
import warnings
from importlib import metadata
from typing import Callable

from omnilearn.config import ConfigError

ALLOW_ENV = "OMNILEARN_ALLOW_UNTESTED"

# distribution -> (lowest tested, first untested): lo <= version < hi. Kept in step with docs/versions.md.
TESTED: dict[str, tuple[str, str]] = {
    "torch": ("2.11", "2.16"),            # 2.13.0 CPU, 2.14.1 and 2.15.0 CUDA builds on the CPU: the whole suite
    "transformers": ("5.18", "5.25"),     # OmniLearnTrainer: 5.18.0, 5.20.2, 5.24.0 (5.17: resume fails on torch 2.13)
    "accelerate": ("1.15", "1.16"),       # under OmniLearnTrainer
    "lightning": ("2.6", "2.7"),          # OmniLearnStrategy, the Fabric door: 2.6.0, 2.6.6
    "pytorch-lightning": ("2.6", "2.7"),
    "ray": ("2.60", "2.61"),              # the Ray Train door: 2.60.0
    "tensorflow-cpu": ("2.21", "2.22"),   # omnilearn.tf
    "tensorflow": ("2.21", "2.22"),
    "keras": ("3.15", "3.16"),
}

_VERSION = re.compile(r"^\s*v?(?:(\d+)!)?(\d+(?:\.\d+)*)")


def parse(version: str) -> tuple[int, tuple[int, ...]] | None:
    """PEP 440's epoch and numeric release of ``version`` ("1!2.14.0" -> (1, (2, 14, 0)); "2.6.0+cpu" and
    "5.0.0rc1" -> (0, (2, 6, 0)), (0, (5, 0, 0))), or None for what is no version ("", "unknown", "dev")."""
    match = _VERSION.match(version or "")
    if match is None:
        return None
    parts = tuple(int(p) for p in match.group(2).split("."))
    return int(match.group(1) or 0), parts + (0,) * (3 - len(parts)) if len(parts) < 3 else parts


def release(version: str) -> tuple[int, ...]:
    """The numeric release of ``version`` ("4.57.1" -> (4, 57, 1)); ValueError for what is no version."""
    parsed = parse(version)
    if parsed is None:
        raise ValueError(f"not a version: {version!r}")
    return parsed[1]


def placement(version: str, lo: str, hi: str) -> str:
    """Where ``version`` lies against ``lo <= version < hi``: "older", "inside", "newer", or "unknown" (no
    version). A pre-release counts as its release; an epoch above 0 sorts after every release of epoch 0."""
    parsed = parse(version)
    if parsed is None:
        return "unknown"
    key = parsed
    if key < (0, release(lo)):
        return "older"
    return "inside" if key < (0, release(hi)) else "newer"


def in_range(version: str, lo: str, hi: str) -> bool:
    """``lo <= version < hi`` by release numbers (a pre-release counts as its release)."""
    return placement(version, lo, hi) == "inside"


def installed(dist: str) -> str | None:
    """The installed version of distribution ``dist``, or None."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _fix(dist: str, lo: str, hi: str) -> str:
    return f"pip install '{dist}>={lo},<{hi}', or set {ALLOW_ENV}=1 to run anyway"


def untested(dist: str, version: str | None, door: str) -> str | None:
    """The one-line refusal for ``version`` of ``dist`` at ``door``, or None when it is in the tested range."""
    if version is None or dist not in TESTED:
        return None
    lo, hi = TESTED[dist]
    where = placement(version, lo, hi)
    if where == "inside":
        return None
    if where == "unknown":
        return (f"{door}: {dist}'s version {version!r} cannot be read, so OmniLearn cannot tell whether it was tested "
                f"({dist}>={lo},<{hi}): {_fix(dist, lo, hi)}")
    return (f"{door}: {dist} {version} is outside the versions OmniLearn was tested with ({dist}>={lo},<{hi}; "
            f"it relies on {dist}'s private names): {_fix(dist, lo, hi)}")


def allowed() -> bool:
    return os.environ.get(ALLOW_ENV, "") not in ("", "0")


def require_tested(dist: str, *, door: str) -> None:
    """Refuse (:class:`ConfigError`) an installed ``dist`` outside ``TESTED[dist]``; with the escape hatch, warn."""
    problem = untested(dist, installed(dist), door)
    if problem is None:
        return
    if allowed():
        warnings.warn(problem, RuntimeWarning, stacklevel=2)
        return
    raise ConfigError(problem)


def torch_problem(version: str | None, door: str, changed: Callable[[], tuple[str, str] | None]) -> tuple[str, bool]:
    """What :func:`require_torch` says of torch ``version`` at ``door``: (the line, whether it refuses); ("", False)
    inside the tested range. ``changed`` gives the first private name that no longer holds (name, used by), or None
    (:func:`omnilearn.torchnames.changed`); it is called only for a release newer than the range or no version.
    :func:`omnilearn.torchnames.require_torch` acts on it (kept there: this module imports no torch)."""
    lo, hi = TESTED["torch"]
    where = placement(version, lo, hi) if version is not None else "unknown"
    if where == "inside":
        return "", False
    if where == "older":
        return untested("torch", version, door) or "", True
    said = (f"torch {version} is newer than the releases OmniLearn was tested with (torch>={lo},<{hi})"
            if where == "newer" else f"torch's version {version!r} cannot be read")
    name = changed()
    if name is None:
        return f"{door}: {said}; the private names of torch it relies on hold, so it runs (docs/versions.md)", False
    return f"{door}: {said} and changed {name[0]}, which OmniLearn relies on ({name[1]}): {_fix('torch', lo, hi)}", True

"""Worker speeds: the paper's heterogeneity levels, speed lists and schedules. Pure.

``--speeds`` is a comma list of relative speeds (``4,2,1``) or a paper level
(``HL1``, ``HL2``, ``HL4``, ``HL8``: CPU cores per worker in the paper's BSP
table, speed taken proportional to cores). A schedule says which speeds hold
from which step: ``paper`` replays HL1->2->4->8->8->4->2->1 in equal blocks
of the run; a TOML file lists changes::

    [[change]]
    at_step = 0          # or at_epoch = 0
    speeds = "HL1"       # or a list: [4, 2, 1]
"""

from __future__ import annotations

import bisect

import math
from dataclasses import dataclass
from typing import Sequence

from omnilearn.tomlfile import read_toml

BSP_LEVELS: dict[str, tuple[float, ...]] = {
    "HL1": (12, 12, 12, 12),
    "HL2": (12, 12, 8, 16),
    "HL4": (9, 9, 6, 24),
    "HL8": (6, 6, 4, 32),
}
ASP_LEVELS: dict[str, tuple[float, ...]] = {
    "HL1": (10, 10, 10, 10),
    "HL2": (8, 8, 8, 16),
    "HL4": (10, 10, 4, 16),
    "HL8": (4, 4, 4, 28),
}
PAPER_ROUTINE = ("HL1", "HL2", "HL4", "HL8", "HL8", "HL4", "HL2", "HL1")


class SpeedError(ValueError):
    """A speed list, level or schedule the user gave cannot be used."""


def parse_speeds(text: str, workers: int, levels: dict[str, tuple[float, ...]] = BSP_LEVELS,
                 workers_said: str | None = None) -> tuple[float, ...]:
    """Parse ``4,2,1`` or ``HL8`` into one positive speed per worker (``HL1``, all equal, fits any count).

    ``workers_said``: where the worker count came from, for the mismatch error (default ``--workers is N``;
    e.g. ``the process group has 2 ranks`` when nobody typed it).
    """
    key = text.strip().upper()
    if key in levels:
        speeds = levels[key]
        if len(set(speeds)) == 1:  # a homogeneous level (HL1): equal speeds at any worker count
            speeds = (speeds[0],) * workers
    elif key.startswith("HL"):
        raise SpeedError(f"unknown heterogeneity level {text!r}; choose one of {', '.join(levels)}")
    else:
        try:
            speeds = tuple(float(s) for s in text.split(","))
        except ValueError:
            raise SpeedError(
                f"cannot read speeds {text!r}; give a comma list such as 4,2,1 or a level {', '.join(levels)}"
            ) from None
    return check_speeds(speeds, workers, text, workers_said)


def speed_count(text: object) -> int | None:
    """How many workers a comma list of speeds (``4,2,1``: 3) names; None for a level (``HL8``) or no list."""
    if not isinstance(text, str) or not text.strip() or text.strip().upper().startswith("HL"):
        return None
    return len(text.split(","))


def check_speeds(speeds: Sequence[float], workers: int, text: str = "", workers_said: str | None = None
                 ) -> tuple[float, ...]:
    label = text or ",".join(f"{s:g}" for s in speeds)
    if len(speeds) != workers:
        said = workers_said or f"--workers is {workers}"
        raise SpeedError(f"speeds {label!r} give {len(speeds)} workers but {said}; give one speed per worker")
    for s in speeds:
        if not (math.isfinite(s) and s > 0):
            raise SpeedError(f"speed {s:g} in {label!r} must be a positive number")
    return tuple(float(s) for s in speeds)


def slowdown(speeds: Sequence[float], rank: int) -> float:
    """Factor by which worker ``rank`` runs slower than the fastest (>= 1)."""
    return max(speeds) / speeds[rank]


@dataclass(frozen=True)
class SpeedSchedule:
    """Speeds in force from each listed step on (``starts[0] == 0``)."""

    starts: tuple[int, ...]
    speeds: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        if not self.starts or self.starts[0] != 0 or list(self.starts) != sorted(set(self.starts)):
            raise SpeedError(f"schedule steps {list(self.starts)} must start at 0 and increase")

    def at(self, step: int) -> tuple[float, ...]:
        return self.speeds[bisect.bisect_right(self.starts, step) - 1]  # starts increase from 0 (checked above)

    def changes_from(self, step: int) -> tuple[int, ...]:
        """The steps, at or after ``step``, at which the speeds change (e.g. those past a run's end)."""
        return tuple(s for s in self.starts if s >= step and s > 0)

    @classmethod
    def constant(cls, speeds: Sequence[float]) -> "SpeedSchedule":
        return cls((0,), (tuple(speeds),))


def paper_schedule(total_steps: int, workers: int, levels: dict[str, tuple[float, ...]] = BSP_LEVELS) -> SpeedSchedule:
    """HL1->2->4->8->8->4->2->1 in equal blocks of ``total_steps`` (4 workers)."""
    if workers != len(levels["HL1"]):
        raise SpeedError(f"the paper schedule is defined for 4 workers, not --workers {workers}")
    n = len(PAPER_ROUTINE)
    starts, speeds = [], []
    for j, level in enumerate(PAPER_ROUTINE):
        start = (j * total_steps) // n
        if starts and start == starts[-1]:
            continue  # a run shorter than 8 steps: the block's first level holds
        starts.append(start)
        speeds.append(levels[level])
    return SpeedSchedule(tuple(starts), tuple(speeds))


def load_schedule(
    path: str, workers: int, steps_per_epoch: int, levels: dict[str, tuple[float, ...]] = BSP_LEVELS
) -> SpeedSchedule:
    """Read a TOML schedule of ``[[change]]`` tables (``at_step`` or ``at_epoch``, ``speeds``)."""
    doc = read_toml(path, "speed schedule", SpeedError)
    changes = doc.get("change")
    if not isinstance(changes, list) or not changes:
        raise SpeedError(f"speed schedule {path!r} has no [[change]] tables; see `omnilearn train --help`")
    points: dict[int, tuple[float, ...]] = {}
    for c in changes:
        try:
            points.update([_change_point(c, path, workers, steps_per_epoch, levels)])
        except SpeedError as e:
            raise SpeedError(f"speed schedule {path!r}: {e}") from None
    if 0 not in points:
        raise SpeedError(f"speed schedule {path!r} must say the speeds at step 0 (at_step = 0 or at_epoch = 0)")
    starts = tuple(sorted(points))
    return SpeedSchedule(starts, tuple(points[s] for s in starts))


def _change_point(c: dict, path: str, workers: int, spe: int, levels: dict) -> tuple[int, tuple[float, ...]]:
    if not isinstance(c, dict) or "speeds" not in c or ("at_step" in c) == ("at_epoch" in c):
        raise SpeedError(f"each [[change]] in {path!r} needs speeds and exactly one of at_step, at_epoch")
    at = c["at_step"] if "at_step" in c else c["at_epoch"]
    if not isinstance(at, int) or isinstance(at, bool) or at < 0:
        raise SpeedError(f"change point {at!r} in {path!r} must be a non-negative integer")
    at = at if "at_step" in c else at * spe
    raw = c["speeds"]
    if isinstance(raw, str):
        return at, parse_speeds(raw, workers, levels)
    if not isinstance(raw, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in raw):
        raise SpeedError(f"speeds {raw!r} in {path!r} must be a level name or a list of numbers")
    return at, check_speeds([float(v) for v in raw], workers)

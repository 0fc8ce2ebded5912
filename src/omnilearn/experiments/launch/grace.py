"""How long a launcher waits for its workers to stop on request before it SIGKILLs them: one policy, both launchers.

SIGINT/SIGTERM to a launcher (``omnilearn train``, ``omnilearn launch``)
becomes SIGTERM to every worker; the workers agree on the stop at their next
control-interval end, write a checkpoint there and exit
(:mod:`omnilearn.stopping`). That takes up to one whole interval of steps,
plus the step in flight, plus the save, so a fixed grace would SIGKILL slow
runs before the promised checkpoint. The launcher reads the pace from what
the workers already write into the run directory, the same files in both
runtimes (:func:`read_pace`):

- the step time: the largest ``step_s`` of the newest step rows
  (``RUN_DIR/steps/rank-<r>.jsonl``, written at every interval end);
- the save time: the largest ``save_s`` of the newest ``checkpoint`` events
  in ``RUN_DIR/metrics.jsonl``;
- the control interval: the launcher's own setting, else ``RUN_DIR/config.toml``'s.

and waits (:func:`grace_s`)::

    grace = FLOOR_S + (interval + 1) x step_s + SAVE_SAFETY x save_s, at most CAP_S

where a run that has not timed a save yet gets :data:`UNTIMED_SAVE_S` for
it: the first save is the slowest (TensorFlow traces its save functions;
every door writes everything once), and on a loaded machine it outlasted a
grace that counted it as nothing.

counted again from every sign of progress toward the stop (:class:`StopWait`):
new step rows up to the interval where the stop is agreed, a checkpoint
being written, a ``metrics.jsonl`` that grows. A run that makes none within
its grace is SIGKILLed; a second signal to the launcher kills at once; and
whatever the progress, never later than :data:`TOTAL_CAP_S` after the request.
Unknown pace (no step row yet: the workers still start) leaves the floor
and the untimed save.

No torch here. Run: ``python -m pytest -q tests/unit/test_stop_grace.py tests/faults/test_slow_stop.py``
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from omnilearn.tomlfile import loads

FLOOR_S = 8.0  # start-up, a fast run's interval end, a small save: the old fixed grace
FAILURE_FLOOR_S = 5.0  # after a failure: a small checkpoint's save, with room for a loaded machine
SAVE_SAFETY = 3.0  # this save may take this many times the last one (a slower disk, a bigger checkpoint)
UNTIMED_SAVE_S = 20.0  # no save timed yet: the first (traced, written whole) on a loaded machine
CAP_S = 600.0  # one grace never beyond this
TOTAL_CAP_S = 1800.0  # nor the whole wait, however the workers progress
DEFAULT_INTERVAL = 15  # TrainConfig's control_interval, when neither the launcher nor config.toml says
TAIL_BYTES = 64 * 1024  # how much of a record file's end is read for the newest rows
PROGRESS_EVERY_S = 0.5  # how often the run directory is looked at for progress


@dataclass(frozen=True)
class Pace:
    """What the run directory says of the workers' pace (None: not known yet)."""

    step_s: float | None = None  # the slowest step of the newest rows
    save_s: float | None = None  # the slowest of the newest checkpoint saves
    interval: int | None = None  # steps between control-interval ends (where a stop is agreed)
    last_step: int | None = None  # the newest step recorded


def grace_s(pace: Pace) -> float:
    """How long the workers get to reach the stop's interval end and save (see the module docstring)."""
    steps = (pace.interval or DEFAULT_INTERVAL) + 1
    wait_s = FLOOR_S + steps * (pace.step_s or 0.0) + save_allowance_s(pace)
    return min(CAP_S, wait_s) if math.isfinite(wait_s) else CAP_S


def rescue_grace_s(pace: Pace) -> float:
    """After a worker died: how long its peers get to save the last completed step (:mod:`omnilearn.bsp.rescue`)
    before they are SIGKILLed. They exit as soon as they saved; the grace only bounds a survivor that hangs."""
    return min(CAP_S, FAILURE_FLOOR_S + SAVE_SAFETY * (pace.save_s or 0.0))


def save_allowance_s(pace: Pace) -> float:
    """The time a grace gives the coming save: :data:`SAVE_SAFETY` times the slowest timed, else
    :data:`UNTIMED_SAVE_S`."""
    return UNTIMED_SAVE_S if pace.save_s is None else SAVE_SAFETY * pace.save_s


def _tail_records(path: Path) -> list[dict]:
    """The whole JSON lines among the last :data:`TAIL_BYTES` of ``path`` (none if it cannot be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.seek(max(0, f.tell() - TAIL_BYTES))
            lines = f.read().decode("utf-8", errors="replace").split("\n")
    except OSError:
        return []
    records = []
    for line in lines[1 if size else 0 : -1]:  # a cut first line (read from the middle) and the unfinished last
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def _interval_of(run_dir: Path) -> int | None:
    try:
        config = loads((run_dir / "config.toml").read_text())
    except (OSError, ValueError):
        return None
    value = config.get("train", config).get("control_interval")
    return value if isinstance(value, int) and value > 0 else None


def read_pace(run_dir: Path, interval: int | None = None) -> Pace:
    """The pace of the run in ``run_dir`` (``interval``: the launcher's setting, else the run's ``config.toml``)."""
    run_dir = Path(run_dir)
    rows = [r for p in sorted((run_dir / "steps").glob("rank-*.jsonl")) for r in _tail_records(p)[-64:]
            if r.get("event") == "step"]
    saves = [r for r in _tail_records(run_dir / "metrics.jsonl") if r.get("event") == "checkpoint"][-3:]
    step_s = max((float(r.get("step_s") or 0.0) for r in rows), default=None)
    save_s = max((float(r.get("save_s") or 0.0) for r in saves), default=None)
    last = max((int(r["step"]) for r in rows if isinstance(r.get("step"), (int, float))), default=None)
    return Pace(step_s, save_s, interval or _interval_of(run_dir), last)


def _signature(run_dir: Path) -> tuple:
    """What changes when the workers get on: the sizes of the record files and what the checkpoints folder holds."""
    sizes = []
    for p in [run_dir / "metrics.jsonl", *sorted((run_dir / "steps").glob("rank-*.jsonl"))]:
        try:
            sizes.append(p.stat().st_size)
        except OSError:
            sizes.append(-1)
    try:
        held = tuple(sorted(p.name for p in (run_dir / "checkpoints").iterdir()))
    except OSError:
        held = ()
    return (*sizes, held)


class StopWait:
    """After a launcher asked its workers to stop: :meth:`overdue` says when to SIGKILL them.

    ``run_dirs``: where the workers of this launch record (several jobs: the most recently written is read);
    ``interval``: the launcher's control interval, if it knows it; ``clock``: seconds (tests script it).
    """

    def __init__(self, run_dirs: Sequence[Path], interval: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.run_dirs, self.interval, self.clock = [Path(d) for d in run_dirs], interval, clock
        self.asked_at: float | None = None
        self.deadline = math.inf
        self.grace = FLOOR_S
        self._seen: tuple = ()
        self._looked_at = -math.inf
        self._limit_step: int | None = None  # step rows past this are a run going on, not toward the stop

    def _run_dir(self) -> Path | None:
        def written(d: Path) -> float:
            try:
                return max((p.stat().st_mtime for p in [d / "metrics.jsonl", *(d / "steps").glob("rank-*.jsonl")]
                            if p.exists()), default=-1.0)
            except OSError:
                return -1.0

        return max(self.run_dirs, key=written, default=None)

    def begin(self) -> float:
        """The stop was asked for now: the grace from the pace read now (seconds)."""
        now = self.clock()
        if self.asked_at is not None:
            return self.grace
        self.asked_at = now
        run_dir = self._run_dir()
        pace = read_pace(run_dir, self.interval) if run_dir is not None else Pace(interval=self.interval)
        self.grace = grace_s(pace)
        if pace.last_step is not None:  # the interval in flight ends the stop; allow one more for a late request
            self._limit_step = pace.last_step + 2 * (pace.interval or DEFAULT_INTERVAL) + 1
        self._seen = _signature(run_dir) if run_dir is not None else ()
        self._looked_at = now
        self.deadline = now + self.grace
        return self.grace

    def overdue(self) -> bool:
        """Whether the workers have had their grace since the request, or since their last progress toward it."""
        if self.asked_at is None:
            return False
        now = self.clock()
        if now - self._looked_at >= PROGRESS_EVERY_S:
            self._looked_at = now
            if self._progressed():
                self.deadline = now + self.grace
        return now > min(self.deadline, self.asked_at + TOTAL_CAP_S)

    def _progressed(self) -> bool:
        run_dir = self._run_dir()
        if run_dir is None:
            return False
        seen = _signature(run_dir)
        if seen == self._seen:
            return False
        self._seen = seen
        last = read_pace(run_dir, self.interval).last_step
        return self._limit_step is None or last is None or last <= self._limit_step

    def failure_grace_s(self) -> float:
        """The survivors' time to save after a worker died (:func:`rescue_grace_s`, from the pace read now)."""
        run_dir = self._run_dir()
        return rescue_grace_s(read_pace(run_dir, self.interval) if run_dir is not None else Pace())

    def why(self) -> str:
        """How the kill came, for the launcher's message."""
        return f"after the stop grace ({self.grace:.0f} s from the request or the workers' last progress)"

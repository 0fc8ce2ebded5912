"""The launchers' grace after a stop on request (:mod:`omnilearn.experiments.launch.grace`), on a scripted clock.

- The pace is read from the run directory's own records: the slowest step of the newest step rows, the slowest of
  the newest checkpoint saves, the control interval (the launcher's, else ``config.toml``'s); cut lines are skipped.
- The grace: floor + (interval + 1) x step + 3 x save, capped; the floor alone while nothing is known.
- :class:`StopWait`: overdue after the grace without progress; new rows or a checkpoint being written count it again;
  rows far past the agreed interval end do not; never beyond the total cap.
- The TensorFlow launcher's stop (:func:`omnilearn.experiments.launch.tfworkers.stop_on_request`): workers that end
  are not killed; overdue ones are, and a second signal kills at once.

Run: ``python -m pytest -q tests/unit/test_stop_grace.py``
"""

from __future__ import annotations

import json
import signal

from omnilearn.experiments.launch import grace
from omnilearn.experiments.launch.grace import Pace, StopWait, grace_s, read_pace


def _rows(run, steps, step_s: float, ranks=(0, 1)) -> None:
    (run / "steps").mkdir(parents=True, exist_ok=True)
    for r in ranks:
        with open(run / "steps" / f"rank-{r}.jsonl", "a") as f:
            for s in steps:
                f.write(json.dumps({"event": "step", "rank": r, "step": s, "step_s": step_s * (1 + r / 10)}) + "\n")


def _event(run, **fields) -> None:
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps(fields) + "\n")


def test_the_pace_comes_from_the_run_directorys_records(tmp_path):
    assert read_pace(tmp_path) == Pace()
    (tmp_path / "config.toml").write_text("[train]\ncontrol_interval = 6\n")
    _rows(tmp_path, range(6), 2.0)
    _event(tmp_path, event="checkpoint", step=6, save_s=0.5)
    _event(tmp_path, event="checkpoint", step=12, save_s=0.25)
    with open(tmp_path / "steps" / "rank-1.jsonl", "a") as f:
        f.write('{"event": "step", "step": 99, "step_s": 10')  # cut by a crash: not a row
    assert read_pace(tmp_path) == Pace(step_s=2.2, save_s=0.5, interval=6, last_step=5)
    assert read_pace(tmp_path, interval=4).interval == 4  # the launcher's own setting wins


def test_the_grace_covers_an_interval_of_steps_and_the_save():
    assert grace_s(Pace()) == grace.FLOOR_S + grace.UNTIMED_SAVE_S  # a save none has timed: the allowance
    assert grace_s(Pace(step_s=2.0, save_s=1.0, interval=6)) == grace.FLOOR_S + 7 * 2.0 + grace.SAVE_SAFETY * 1.0
    assert grace_s(Pace(step_s=1e6, interval=6)) == grace.CAP_S
    assert grace_s(Pace(step_s=2.0, save_s=0.0, interval=6)) == grace.FLOOR_S + 7 * 2.0  # a save timed at nothing


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_stop_wait_counts_again_while_the_workers_progress_toward_the_stop(tmp_path):
    clock = Clock()
    _rows(tmp_path, range(6), 2.0, ranks=(0,))
    wait = StopWait([tmp_path], interval=6, clock=clock)
    assert not wait.overdue()  # nothing asked yet
    g = wait.begin()
    assert g == grace.FLOOR_S + 7 * 2.0 + grace.UNTIMED_SAVE_S
    clock.now += g - 1
    assert not wait.overdue()
    _rows(tmp_path, range(6, 12), 2.0, ranks=(0,))  # the interval the stop is agreed at
    clock.now += 1
    assert not wait.overdue()  # progress: counted again from here
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / ".step-000000012.pt.tmp").write_text("")  # the save under way
    clock.now += g - 1
    assert not wait.overdue()
    clock.now += g + 1
    assert wait.overdue()  # no progress for a whole grace


def test_stop_wait_ignores_a_run_that_trains_on_and_is_capped(tmp_path):
    clock = Clock()
    _rows(tmp_path, range(6), 1.0, ranks=(0,))
    wait = StopWait([tmp_path], interval=6, clock=clock)
    g = wait.begin()
    for k in range(1, 6):  # rows far past the interval where the stop should have been agreed
        clock.now += g / 2
        _rows(tmp_path, range(6 * k, 6 * k + 6), 1.0, ranks=(0,))
        wait.overdue()
    assert wait.overdue()
    endless = StopWait([tmp_path / "none"], clock=clock)  # a checkpoint folder growing for ever
    endless.begin()
    folder = tmp_path / "none" / "checkpoints"
    folder.mkdir(parents=True)
    for k in range(int(2 * grace.TOTAL_CAP_S / grace.FLOOR_S) + 4):
        (folder / f"f{k}").write_text("")
        clock.now += grace.FLOOR_S / 2
        if endless.overdue():
            break
    assert endless.overdue() and clock.now - endless.asked_at <= grace.TOTAL_CAP_S + grace.FLOOR_S


class Worker:
    """A worker process as the TF launcher sees it: ends ``polls`` polls after SIGTERM (None: never)."""

    def __init__(self, polls: int | None) -> None:
        self.polls, self.returncode, self.signals = polls, None, []

    def poll(self):
        if self.returncode is None and signal.SIGTERM in self.signals and self.polls is not None:
            self.polls -= 1
            if self.polls <= 0:
                self.returncode = 128 + signal.SIGTERM
        return self.returncode

    def send_signal(self, signum):
        self.signals.append(signum)

    def kill(self):
        self.signals.append(signal.SIGKILL)
        self.returncode = -signal.SIGKILL

    def wait(self):
        return self.returncode


class Trap:
    def __init__(self, *received) -> None:
        self.received = list(received)


class Overdue:
    """A StopWait that says overdue after ``after`` looks."""

    def __init__(self, after: int) -> None:
        self.after = after

    def begin(self) -> float:
        return 1.0

    def overdue(self) -> bool:
        self.after -= 1
        return self.after < 0

    def why(self) -> str:
        return "after the stop grace"


def test_the_tf_launcher_waits_for_its_workers_and_kills_only_when_overdue_or_told_twice(monkeypatch):
    from omnilearn.experiments.launch import tfworkers

    monkeypatch.setattr(tfworkers, "POLL_S", 0)
    ending = [Worker(3), Worker(5)]
    assert tfworkers.stop_on_request(ending, Trap(signal.SIGINT), Overdue(10)) == ""
    assert all(w.signals == [signal.SIGTERM] for w in ending)
    stuck = [Worker(2), Worker(None)]
    assert tfworkers.stop_on_request(stuck, Trap(signal.SIGINT), Overdue(4)) == "after the stop grace"
    assert stuck[0].signals == [signal.SIGTERM] and stuck[1].signals == [signal.SIGTERM, signal.SIGKILL]
    again = [Worker(None)]
    assert tfworkers.stop_on_request(again, Trap(signal.SIGINT, signal.SIGINT), Overdue(100)) == "on a second signal"
    assert again[0].returncode == -signal.SIGKILL

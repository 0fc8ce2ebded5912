"""A stop asked of a run with slow steps still ends at its agreed step with a checkpoint, and resumes from it.

Each step of ``omnilearn train`` (2 local workers, gloo on CPU) is made to take :data:`STEP_S` by a test-only
``sitecustomize`` (a sleep inside the timed compute), with a control interval of :data:`INTERVAL` steps: a stop agreed
at the next interval end comes more than ``(INTERVAL - 1) x STEP_S`` after the signal, more than the fixed grace the
launcher once had (8 s), so the workers were SIGKILLed before their checkpoint. SIGTERM to the launcher just after an
interval end: the launcher waits (:class:`omnilearn.experiments.launch.grace.StopWait`, from the measured step time),
no worker is SIGKILLed, the checkpoint of the agreed step is written, and ``--resume`` continues from that step (fast
steps) to the end. Watched through the run's own files; nothing is timed.

Run: ``python -m pytest -q tests/faults/test_slow_stop.py`` (about a minute on 2 cores).
"""

from __future__ import annotations

import signal
import textwrap

import pytest
from runfiles import raw_events

pytestmark = pytest.mark.dist

STEP_S = 1.5
INTERVAL = 8
TOTAL_STEPS = 32
HANG_GUARD_S = 300.0  # only a hung run gets here: never a measure of speed
SLOW_STEPS = """
import os, time
_step_s = float(os.environ.get("OMNILEARN_TEST_STEP_S") or 0)
if _step_s:
    from omnilearn.experiments.train import trainer as _trainer
    _loss = _trainer.BSPTrainer._loss

    def _slow_loss(self, micro_batch):  # inside the timed step: the step rows show the slow steps
        time.sleep(_step_s)
        return _loss(self, micro_batch)

    _trainer.BSPTrainer._loss = _slow_loss
"""
FLAGS = ("--workers", "2", "--dataset", "synthetic", "--speeds", "1,1", "--global-batch", "16", "--epochs", "1000",
         "--max-steps", str(TOTAL_STEPS), "--control-interval", str(INTERVAL), "--checkpoint-every", "0", "--no-plots")


def _rows_written(run) -> int:
    return len(raw_events(run.run_dir, "step")) if run.training() else 0


def _checkpoint_steps(run_dir) -> list[int]:
    return sorted(int(p.name[5:-5]) for p in (run_dir / "checkpoints").glob("step-*.json"))


def test_a_stop_with_slow_steps_checkpoints_at_the_agreed_step_and_resumes(start_train, wait_for, tmp_path,
                                                                          monkeypatch):
    hook = tmp_path / "slowsteps"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(textwrap.dedent(SLOW_STEPS))
    monkeypatch.setenv("PYTHONPATH", str(hook))
    monkeypatch.setenv("OMNILEARN_TEST_STEP_S", str(STEP_S))
    run = start_train(*FLAGS)
    wait_for(lambda: _rows_written(run) or run.proc.poll() is not None, HANG_GUARD_S, "the first interval ends")
    assert run.proc.poll() is None, run.stderr()
    seen = max(r["step"] for r in raw_events(run.run_dir, "step"))
    assert seen == INTERVAL - 1 and not _checkpoint_steps(run.run_dir)
    run.proc.send_signal(signal.SIGTERM)  # the workers are early in the second interval
    code = run.proc.wait(timeout=HANG_GUARD_S)
    last = run.stderr().strip().splitlines()[-1]
    assert code == 128 + signal.SIGTERM and "interrupted by SIGTERM: every worker was asked to stop (SIGTERM)" in last
    assert "SIGKILL" not in last, last  # nobody was killed before the checkpoint
    saved = _checkpoint_steps(run.run_dir)
    assert saved and saved[-1] % INTERVAL == 0 and saved[-1] > seen, saved  # at the interval end the stop was agreed

    monkeypatch.delenv("OMNILEARN_TEST_STEP_S")  # the rest at full speed
    again = start_train("--out", str(run.run_dir), "--resume", "--no-plots")
    assert again.proc.wait(timeout=HANG_GUARD_S) == 0, again.stderr()[-3000:]
    said = (again.logs / "stdout.txt").read_text() + again.stderr()
    assert f"training resumes at step {saved[-1]} of {TOTAL_STEPS} steps" in said, said[-3000:]

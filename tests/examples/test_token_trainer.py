"""``examples/token_trainer.py`` (nanoGPT-style random windows) under torchrun, rank 1 emulated 3x slower.

A run of 40 steps (autocast and gradient accumulation on, checkpoints every 20) rebalances toward the
fast worker and its loss falls; a second run with ``--resume`` continues from the step-40 checkpoint
to step 60.

Run: ``python -m pytest -q tests/examples/test_token_trainer.py``
"""

from __future__ import annotations

import json

import pytest

from runexample import assert_balanced_and_learning, scripted_timings, torchrun

pytestmark = pytest.mark.dist


def test_token_trainer_rebalances_learns_and_resumes(tmp_path):
    out = tmp_path / "run"
    done = torchrun("token_trainer.py", "--speeds", "3,1", "--max-steps", "40", "--amp", "--out", str(out),
                    env=scripted_timings("3,1"))
    summary = assert_balanced_and_learning(out)
    assert summary["steps"] == 40 and "final batches" in done.stdout
    assert (out / "checkpoints" / "step-000000040.pt").is_file()
    done = torchrun("token_trainer.py", "--speeds", "3,1", "--max-steps", "60", "--amp", "--resume", "--out", str(out),
                    env=scripted_timings("3,1"))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_at_step"] == 40 and summary["steps"] == 60, summary
    assert "resumed at step 40 with 2 workers" in done.stdout + done.stderr

"""``examples/token_trainer.py`` (nanoGPT-style random windows) under torchrun, rank 1 emulated 3x slower.

It rebalances toward the fast worker and its loss falls (with autocast and gradient accumulation on),
and a run stopped at step 40 resumes from its checkpoint and finishes at step 60.

Run: ``python -m pytest -q tests/examples/test_token_trainer.py``
"""

from __future__ import annotations

import json

import pytest

from runexample import assert_balanced_and_learning, torchrun

pytestmark = pytest.mark.dist


def test_token_trainer_rebalances_and_learns(tmp_path):
    out = tmp_path / "run"
    done = torchrun("token_trainer.py", "--speeds", "3,1", "--max-steps", "60", "--amp", "--out", str(out))
    summary = assert_balanced_and_learning(out)
    assert summary["steps"] == 60 and "final batches" in done.stdout


def test_token_trainer_resumes_from_its_checkpoint(tmp_path):
    out = tmp_path / "run"
    torchrun("token_trainer.py", "--speeds", "3,1", "--max-steps", "40", "--out", str(out))
    assert (out / "checkpoints" / "step-000000040.pt").is_file()
    done = torchrun("token_trainer.py", "--speeds", "3,1", "--max-steps", "60", "--resume", "--out", str(out))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_at_step"] == 40 and summary["steps"] == 60, summary
    assert "resumed at step 40 with 2 workers" in done.stdout + done.stderr

"""``examples/own_model.py`` (your own model and dataset, gradient accumulation) under torchrun, rank 1 3x slower.

Run: ``python -m pytest -q tests/examples/test_own_model.py``
"""

from __future__ import annotations

import pytest

from omnilearn.observe.metrics import read_metrics
from runexample import assert_balanced_and_learning, scripted_timings, torchrun

pytestmark = pytest.mark.dist


def test_own_model_example_rebalances_and_learns_with_accumulation(tmp_path):
    out = tmp_path / "run"
    done = torchrun("own_model.py", "--speeds", "3,1", "--epochs", "1", "--accumulation-steps", "2", "--out", str(out),
                    env=scripted_timings("3,1"))
    summary = assert_balanced_and_learning(out)
    changes = [d for d in read_metrics(out, "decision") if d["changed"]]
    assert changes and all(sum(d["new"]) == 128 for d in changes)
    assert summary["test_accuracy"] > 0.4  # four classes: it learned something
    assert "final batches" in done.stdout

"""``examples/lightning_example.py`` (``Trainer(strategy=OmniLearnStrategy(...))``) under torchrun, rank 1 3x slower.

It rebalances toward the fast worker, its loss falls, and the per-worker batches reach Lightning's logger.

Run: ``python -m pytest -q tests/examples/test_lightning_example.py``
"""

from __future__ import annotations

import csv

import pytest

from runexample import assert_balanced_and_learning, scripted_timings, torchrun

pytest.importorskip("lightning")
pytestmark = pytest.mark.dist


def test_lightning_example_rebalances_learns_and_logs_batches(tmp_path):
    out, logs = tmp_path / "run", tmp_path / "logs"
    done = torchrun("lightning_example.py", "--speeds", "3,1", "--out", str(out), "--csv-dir", str(logs),
                    env=scripted_timings("3,1"))
    assert_balanced_and_learning(out)
    assert "final batches" in done.stdout
    rows = list(csv.DictReader((logs / "example" / "version_0" / "metrics.csv").open()))
    fast = [float(r["omnilearn/batch_rank0"]) for r in rows if r.get("omnilearn/batch_rank0")]
    slow = [float(r["omnilearn/batch_rank1"]) for r in rows if r.get("omnilearn/batch_rank1")]
    assert fast and fast[-1] > slow[-1] and fast[-1] + slow[-1] == 128, (fast[-1:], slow[-1:])

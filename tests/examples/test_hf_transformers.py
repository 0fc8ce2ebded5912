"""``examples/hf_transformers.py`` (a GPT-2 built from a local config) under torchrun, rank 1 emulated 3x slower.

Run: ``python -m pytest -q tests/examples/test_hf_transformers.py``
"""

from __future__ import annotations

import pytest
from needs import needs

from runexample import assert_balanced_and_learning, scripted_timings, torchrun

pytestmark = [pytest.mark.dist, needs("transformers", "hf")]


def test_hf_example_rebalances_and_learns(tmp_path):
    out = tmp_path / "run"
    done = torchrun("hf_transformers.py", "--speeds", "3,1", "--out", str(out), env=scripted_timings("3,1"))
    summary = assert_balanced_and_learning(out)
    assert summary["rebalances"] >= 1 and "final batches" in done.stdout

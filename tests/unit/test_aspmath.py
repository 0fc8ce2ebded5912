"""ASP maths: exact data coverage of the dealer, per-push learning rate, staleness accounting.

Run: ``python -m pytest -q tests/unit/test_aspmath.py``.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnilearn.asp.rules import IndexDealer, Staleness, push_lr


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 300), batches=st.lists(st.integers(1, 64), min_size=1, max_size=400),
       seed=st.integers(0, 2**32))
def test_every_sample_is_dealt_exactly_once_per_epoch_whatever_the_batches(n, batches, seed):
    dealer = IndexDealer(n, seed)
    seen: dict[int, list[int]] = {}
    for b in batches:
        epoch, idx = dealer.deal(b)
        assert 1 <= len(idx) <= b
        seen.setdefault(epoch, []).extend(idx)
    epochs = sorted(seen)
    assert epochs == list(range(len(epochs)))
    for e in epochs[:-1]:  # completed epochs: a permutation of the dataset
        assert sorted(seen[e]) == list(range(n))
    assert len(set(seen[epochs[-1]])) == len(seen[epochs[-1]])  # the current one: no repeats so far


def test_epochs_use_different_seeded_orders():
    a, b = IndexDealer(50, seed=1), IndexDealer(50, seed=1)
    first = a.deal(50)[1]
    assert first == b.deal(50)[1]  # deterministic
    assert a.deal(50) != (0, first) and a.epoch == 1
    assert IndexDealer(50, seed=2).deal(50)[1] != first
    with pytest.raises(ValueError):
        a.deal(0)


def test_linear_scaling_and_staleness_aware_rate():
    assert push_lr(0.1, 64, 32.0, 0, "linear", False) == pytest.approx(0.2)
    assert push_lr(0.1, 16, 32.0, 5, "linear", False) == pytest.approx(0.05)
    assert push_lr(0.1, 16, 32.0, 5, "none", False) == pytest.approx(0.1)
    assert push_lr(0.1, 64, 32.0, 4, "linear", True) == pytest.approx(0.05)
    assert push_lr(0.1, 64, 32.0, 0, "linear", True) == pytest.approx(0.2)  # fresh: divided by 1, not 0
    with pytest.raises(ValueError, match="lr scaling"):
        push_lr(0.1, 1, 1.0, 0, "sqrt", False)


def test_staleness_is_server_version_minus_pulled_version():
    s = Staleness(2)
    assert s.record(0, server_version=0, pulled_version=0) == 0
    assert s.record(1, server_version=1, pulled_version=0) == 1
    assert s.record(1, server_version=5, pulled_version=1) == 4
    assert (s.counts, s.maxima) == ([1, 2], [0, 4])
    assert s.mean(1) == pytest.approx(2.5) and s.mean(0) == 0
    with pytest.raises(ValueError, match="newer than the server"):
        s.record(0, server_version=3, pulled_version=4)

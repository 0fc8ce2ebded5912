"""ASP rules: data coverage of the dealer, per-push rate, staleness, liveness, training clock, settings, control.

Run: ``python -m pytest -q tests/unit/test_aspmath.py``.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnilearn.asp.control import PushControl
from omnilearn.asp.rules import IndexDealer, Liveness, Staleness, push_lr
from omnilearn.asp.settings import ASPSettings
from omnilearn.balance.allocation import Bounds
from omnilearn.balance.controllers import make_controller
from omnilearn.balance.loop import ControlLoop
from omnilearn.config import ConfigError
from omnilearn.trainclock import TrainClock


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


def test_liveness_names_the_quietest_worker_past_the_timeout():
    live = Liveness(3, timeout_s=5.0)
    live.start(100.0)
    live.heard(0, 103.0)
    live.heard(2, 104.0)
    assert live.quietest(104.0, set()) == (1, 4.0) and live.silent(104.0, set()) is None
    assert live.silent(105.5, set()) == (1, 5.5)
    assert live.silent(105.5, {1}) is None and live.quietest(105.5, {0, 1, 2}) is None


def test_train_clock_leaves_pauses_out():
    clock = TrainClock()
    clock.start(10.0)
    assert clock.train_s(12.0) == 2.0
    clock.pause(12.0)
    assert clock.train_s(30.0) == 2.0  # frozen while paused
    clock.resume(30.0)
    clock.resume(31.0)  # a second resume changes nothing
    assert clock.train_s(33.0) == pytest.approx(5.0) and clock.wall_s(33.0) == 23.0


def test_asp_settings_are_validated():
    assert ASPSettings().lr_scaling == "linear"
    with pytest.raises(ConfigError, match="lr_scaling"):
        ASPSettings(lr_scaling="sqrt")
    with pytest.raises(ConfigError, match="--max-time-s"):
        ASPSettings(max_time_s=0.0)


def test_push_control_windows_only_the_current_batch_and_decides_every_interval():
    loop = ControlLoop(make_controller("omnilearn", Bounds(64, 2, 8, None), (1.0, 1.0)), total_steps=10_000)
    control = PushControl(loop, interval_pushes=8)
    version, decisions = 0, []
    for k in range(80):
        worker = k % 2
        version += 1
        batch = control.batches[worker] if k % 5 else 5  # every fifth push at another batch: left out
        if control.record(worker, batch, 0.01 if worker == 0 else 0.03):
            decisions.append(control.decide(version))
        assert control.held_times <= 8
    assert len(decisions) == 10
    assert any(d.changed for d in decisions) and control.batches[0] > control.batches[1]
    state = control.state_dict()
    again = PushControl(ControlLoop(make_controller("omnilearn", Bounds(64, 2, 8, None), (1.0, 1.0))), 8)
    again.load_state_dict(state)
    assert again.batches == control.batches and again.state_dict() == state

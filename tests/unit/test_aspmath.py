"""ASP rules: data coverage of the dealer (also with indices taken back and dealt again), per-push rate,
staleness, liveness (allowances, how long the server may wait), training clock, settings, control (also after a
worker is dropped), state round trips, the fault-injection variable.

Run: ``python -m pytest -q tests/unit/test_aspmath.py``.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import random

from omnilearn.asp.control import PushControl
from omnilearn.asp.faults import ENV, KillPoint, kill_point
from omnilearn.asp.rules import Coverage, IndexDealer, Liveness, Staleness, push_lr
from omnilearn.asp.settings import ASPSettings
from omnilearn.balance.allocation import Bounds, proportional_split
from omnilearn.balance.controllers import make_controller
from omnilearn.balance.loop import ControlLoop
from omnilearn.config import ConfigError
from omnilearn.clocks.train import TrainClock


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


def test_liveness_allows_start_up_then_heartbeats_capped_at_the_timeout():
    live = Liveness(3, timeout_s=30.0, heartbeat_s=5.0)
    live.start()
    live.heard(0)
    live.heard(2)
    assert [live.allowance_s(w) for w in range(3)] == [5.0, 30.0, 5.0]  # worker 1 has not spoken: start-up
    capped = Liveness(1, timeout_s=3.0, heartbeat_s=60.0)  # a heartbeat above the timeout: capped
    capped.start()
    assert capped.allowance_s(0) == 3.0
    capped.heard(0)
    assert capped.allowance_s(0) == 3.0
    plain = Liveness(1, timeout_s=7.0)  # no heartbeat: the timeout throughout
    plain.start()
    plain.heard(0)
    assert plain.allowance_s(0) == 7.0


def _deal_and_drop(dealer: IndexDealer, workers: int, rounds: int, rng: random.Random, applied: list,
                   coverage: Coverage) -> dict[int, tuple[int, list[int]]]:
    """Workers ask in random order; a push applies its deal; now and then a worker dies holding one. What they hold."""
    held: dict[int, tuple[int, list[int]]] = {}
    for _ in range(rounds):
        w = rng.randrange(workers)
        if w in held and rng.random() < 0.1:  # dies holding its deal: taken back, dealt again to whoever asks
            dealer.take_back(*held.pop(w))
            continue
        if w in held:
            epoch, idx = held.pop(w)
            applied.append((epoch, idx))
            coverage.add(epoch, idx)
        held[w] = dealer.deal(rng.randint(1, 40))
    return held


@settings(max_examples=150, deadline=None)
@given(n=st.integers(1, 200), workers=st.integers(1, 5), rounds=st.integers(1, 300), seed=st.integers(0, 2**32))
def test_taken_back_indices_are_dealt_again_so_every_sample_is_applied_once_per_epoch(n, workers, rounds, seed):
    dealer, coverage, applied = IndexDealer(n, seed % 7), Coverage(n), []
    held = _deal_and_drop(dealer, workers, rounds, random.Random(seed), applied, coverage)
    for epoch, idx in held.values():  # the end: the survivors push what they hold
        applied.append((epoch, idx))
        coverage.add(epoch, idx)
    used: dict[int, list[int]] = {}  # per epoch: applied
    for epoch, idx in applied:
        used.setdefault(epoch, []).extend(idx)
    to_come = {e: list(used.get(e, [])) for e in range(dealer.epoch + 1)}  # plus taken back, not dealt again yet
    for epoch, idx in dealer.returned:
        to_come[epoch].extend(idx)
    for epoch, idx in to_come.items():  # every dealt sample once, none lost: a whole epoch, or up to the cursor
        assert len(idx) == len(set(idx)), f"epoch {epoch} used a sample twice"
        assert len(idx) == (n if epoch < dealer.epoch else dealer.cursor), (epoch, len(idx))
    assert coverage.repeats == 0
    assert coverage.applied == [len(used.get(e, [])) for e in range(len(coverage.applied))]
    assert set(coverage.summary()["complete_epochs"]) == {e for e, idx in used.items() if len(idx) == n}
    assert dealer.dealt == sum(len(i) for _, i in applied)


def test_dealer_deals_taken_back_indices_first_oldest_epoch_first_never_mixing_epochs():
    dealer = IndexDealer(10, seed=3)
    e0a = dealer.deal(6)
    e0b = dealer.deal(6)  # the epoch's short last batch: 4
    e1 = dealer.deal(3)
    assert (e0a[0], e0b[0], e1[0], len(e0b[1])) == (0, 0, 1, 4)
    dealer.take_back(*e1)
    dealer.take_back(*e0b)
    assert dealer.queued == 7 and dealer.dealt == 6
    assert dealer.deal(3) == (0, e0b[1][:3])  # epoch 0 first, in slices of the asked batch
    assert dealer.deal(5) == (0, e0b[1][3:])  # the rest of it alone: a batch never mixes epochs
    assert dealer.deal(5) == (1, e1[1])
    assert dealer.deal(2)[0] == 1 and dealer.queued == 0
    with pytest.raises(ValueError, match="epoch 2"):
        dealer.take_back(2, [1])


def test_dealer_state_round_trip_deals_the_pending_indices_again():
    rng = random.Random(5)
    dealer = IndexDealer(50, seed=9)
    held = _deal_and_drop(dealer, 3, 40, rng, [], Coverage(50))
    state = dealer.state_dict(pending=held.values())
    again = IndexDealer(50, seed=9)
    again.load_state_dict(state)
    for epoch, idx in held.values():  # what a restart must deal: the held ones as if taken back
        dealer.take_back(epoch, idx)
    assert [again.deal(b) for b in (7, 30, 13, 50, 1)] == [dealer.deal(b) for b in (7, 30, 13, 50, 1)]
    assert again.state_dict() == dealer.state_dict()
    with pytest.raises(ValueError, match="seed"):
        IndexDealer(50, seed=1).load_state_dict(state)


def test_coverage_counts_repeats_and_round_trips():
    cov = Coverage(5)
    cov.add(0, [0, 1, 2])
    cov.add(0, [2, 3])  # 2 again: a repeat
    cov.add(1, [4])
    cov.add(0, [4])
    assert cov.summary() == {"samples_per_epoch": [6, 1], "repeated_samples": 1, "complete_epochs": [0]}
    cov.add(0, [1])  # a complete epoch applied again: a repeat too
    assert cov.repeats == 2 and cov.open.keys() == {1}
    again = Coverage(5)
    again.load_state_dict(cov.state_dict())
    again.add(1, [0, 1, 2, 3])
    assert again.summary() == {"samples_per_epoch": [7, 5], "repeated_samples": 2, "complete_epochs": [0, 1]}
    with pytest.raises(ValueError, match="outside"):
        cov.add(0, [5])


def test_staleness_state_round_trip():
    s = Staleness(2)
    s.record(1, 5, 2)
    again = Staleness(2)
    again.load_state_dict(s.state_dict())
    assert again.state_dict() == s.state_dict() and again.mean(1) == 3.0


def test_train_clock_leaves_pauses_out():
    clock = TrainClock()
    clock.start(10.0)
    assert clock.train_s(12.0) == 2.0
    clock.pause(12.0)
    assert clock.train_s(30.0) == 2.0  # frozen while paused
    clock.resume(30.0)
    clock.resume(31.0)  # a second resume changes nothing
    assert clock.train_s(33.0) == pytest.approx(5.0) and clock.wall_s(33.0) == 23.0


def test_a_step_end_freezes_the_training_time_as_train_s_reads_it():
    clock = TrainClock()
    clock.step_ended()  # before the first step: nothing counted
    assert clock.at_last_step_s == 0.0
    clock.restore(7.0)
    clock.start()
    clock.pause()
    clock.resume()
    before = clock.train_s()
    clock.step_ended()  # the inline reading (not paused) lies between two of train_s's
    assert before <= clock.at_last_step_s <= clock.train_s() and before >= 7.0
    clock.pause()
    clock.step_ended()  # paused: frozen at the pause
    assert clock.at_last_step_s == clock.train_s() == clock.train_s(clock.pause_began_s + 5.0)


def test_asp_settings_are_validated():
    assert ASPSettings().lr_scaling == "linear"
    with pytest.raises(ConfigError, match="lr_scaling"):
        ASPSettings(lr_scaling="sqrt")
    with pytest.raises(ConfigError, match="--max-time-s"):
        ASPSettings(max_time_s=0.0)
    assert ASPSettings(checkpoint_every=5).checkpoint_every == 5
    with pytest.raises(ConfigError, match="--checkpoint-every"):
        ASPSettings(checkpoint_every=-1)
    assert ASPSettings(max_staleness=6).max_staleness == 6
    for bad in (0, 2.5, True):
        with pytest.raises(ConfigError, match="--max-staleness"):
            ASPSettings(max_staleness=bad)


def test_staleness_quantiles_are_exact_and_survive_a_checkpoint_and_an_older_one_loads():
    s = Staleness(2)
    for stale in [0, 1, 1, 2, 2, 2, 3, 9]:  # worker 0; 8 pushes
        s.record(0, 100, 100 - stale)
    s.record(1, 100, 45)
    assert (s.quantile(0.5, 0), s.quantile(0.99, 0), s.quantile(0.99)) == (2, 9, 55)
    assert s.quantile(0.5, 1) == 55 and Staleness(3).quantile(0.99) == 0  # no pushes yet: 0
    again = Staleness(2)
    again.load_state_dict(s.state_dict())
    assert again.hist == s.hist and again.quantile(0.99, 0) == 9
    older = {k: v for k, v in s.state_dict().items() if k in ("counts", "totals", "maxima")}
    again.load_state_dict(older)  # a checkpoint from before the histogram: quantiles start afresh
    assert again.counts == s.counts and again.quantile(0.5) == 0 and again.refused == [0, 0]


def test_push_control_windows_only_the_current_batch_and_decides_every_interval():
    loop = ControlLoop(make_controller("omnilearn", Bounds(64, 2, 8, None), (1.0, 1.0)), total_steps=10_000)
    control = PushControl(loop, control_interval=4)
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
    again = PushControl(ControlLoop(make_controller("omnilearn", Bounds(64, 2, 8, None), (1.0, 1.0))), 4)
    again.load_state_dict(state)
    assert again.batches == control.batches and again.state_dict() == state


def _loop_for(global_batch: int, max_batch: int | None = None):
    def new_loop(live, batches=None) -> ControlLoop:
        total = min(global_batch, len(live) * (max_batch or global_batch))
        loop = ControlLoop(make_controller("omnilearn", Bounds(total, len(live), 8, max_batch), [1.0] * len(live)))
        if batches is not None:
            plan = proportional_split(batches, Bounds(total, len(live), 8, max_batch))
            loop.load_state_dict({"batches": plan, "slot": 0, "windows": [[] for _ in live]})
        return loop
    return new_loop


def test_a_dropped_workers_share_goes_to_the_others_in_proportion():
    new_loop = _loop_for(120)
    control = PushControl(new_loop([0, 1, 2]), control_interval=2, new_loop=new_loop)
    control.loop.load_state_dict({"batches": [60, 40, 20], "slot": 0, "windows": [[], [], []]})
    assert control.drop(1) == (90, 0, 30) and control.interval_pushes == 4  # 60:20 kept, sum B
    assert not control.record(1, 30, 0.1) and control.pushes == 0  # a dropped worker's late push is left out
    for _ in range(2):
        control.record(0, 90, 0.01)
        due = control.record(2, 30, 0.03)
    assert due and control.decide(10).times_s == pytest.approx((0.01, 0.03))
    state = control.state_dict()
    again = PushControl(new_loop([0, 1, 2]), 2, new_loop)
    again.load_state_dict(state)  # a state of the live workers only rebuilds the loop for them
    assert again.batches == (90, 0, 30) and again.live == [0, 2] and again.state_dict() == state
    assert control.drop(2) == (120, 0, 0) and control.drop(0) == (0, 0, 0)
    capped = _loop_for(120, max_batch=50)
    tight = PushControl(capped([0, 1, 2]), 2, capped)
    assert tight.drop(0) == (0, 50, 50)  # 2 x max_batch cannot hold B: each runs at its largest batch


def test_fault_kill_point_is_read_from_the_environment(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert kill_point(2) is None
    monkeypatch.setenv(ENV, "2:5")
    assert kill_point(2) == KillPoint(2, 5, "before") and kill_point(1) is None
    monkeypatch.setenv(ENV, "1:7:after")
    assert kill_point(1) == KillPoint(1, 7, "after")
    monkeypatch.setenv(ENV, "0:30")
    assert kill_point(0) == KillPoint(0, 30) and kill_point(2) is None
    for bad in ("2", "x:1", "2:0", "2:5:during", "1:2:before:x", "0:30:after"):
        monkeypatch.setenv(ENV, bad)
        with pytest.raises(ValueError, match=ENV):
            kill_point(2)

"""Unit tests for the variable-batch data path (``omnilearn.data.plan``).

Checks the properties the design promises: every index exactly once per epoch
(the ``N mod B`` remainder dropped) under any sequence of batch-size changes;
the samples of a step and their order do not depend on the number of workers
or on the split; seeded per-epoch permutations; input validation; and the
sampler used as ``batch_sampler`` of a real ``DataLoader`` (also with worker
processes and prefetching) with schedule changes registered at runtime.
Then micro-batches (gradient accumulation), the sampler's place (set_epoch
forward only, complete, end_epoch, state round trip) and the
:class:`BalancedLoader`'s iteration rules (peek, break, exhaustion,
replaced iterators).

Run:  cd /work/main && python -m pytest -q tests/unit/test_sampler.py
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, TensorDataset

from omnilearn.data.loader import BalancedLoader
from omnilearn.data.plan import BatchSchedule, GlobalPlan, VariableBatchSampler, micro_sizes

SETTINGS = settings(max_examples=100, deadline=None)


@st.composite
def split(draw, total: int, workers: int) -> tuple[int, ...]:
    """A random composition of ``total`` into ``workers`` positive parts."""
    if workers == 1:
        return (total,)
    cuts = sorted(draw(st.sets(st.integers(1, total - 1), min_size=workers - 1, max_size=workers - 1)))
    bounds = [0, *cuts, total]
    return tuple(bounds[i + 1] - bounds[i] for i in range(workers))


@st.composite
def run_setup(draw):
    """Dataset size, global batch, worker count, epochs, and batch-vector changes by step."""
    global_batch = draw(st.integers(1, 24))
    dataset_len = draw(st.integers(global_batch, 120))
    workers = draw(st.integers(1, min(global_batch, 6)))
    epochs = draw(st.integers(1, 3))
    plan = GlobalPlan(dataset_len, global_batch, seed=draw(st.integers(0, 2**31)))
    total = plan.steps_per_epoch * epochs
    initial = draw(split(global_batch, workers))
    change_steps = draw(st.sets(st.integers(1, max(1, total - 1)), max_size=8)) if total > 1 else set()
    changes = {s: draw(split(global_batch, workers)) for s in sorted(change_steps)}
    return plan, workers, epochs, initial, changes


def concat(plan: GlobalPlan, step: int, batches) -> list[int]:
    return [i for r in range(len(batches)) for i in plan.worker_indices(step, batches, r)]


# ---------------------------------------------------------------- coverage per epoch


@SETTINGS
@given(run_setup())
def test_every_index_once_per_epoch_with_changing_batches(setup):
    plan, workers, epochs, initial, changes = setup
    spe, B, N = plan.steps_per_epoch, plan.global_batch, plan.dataset_len
    schedules = [BatchSchedule(initial) for _ in range(workers)]  # one per rank, as in real runs
    samplers = [VariableBatchSampler(plan, schedules[r], r) for r in range(workers)]
    in_force = initial
    step = 0
    for epoch in range(epochs):
        for s in samplers:
            s.set_epoch(epoch)
        seen: list[int] = []
        for per_rank in zip(*samplers):
            in_force = changes.get(step, in_force)
            assert [len(x) for x in per_rank] == list(in_force)
            flat = [i for x in per_rank for i in x]
            assert flat == plan.step_indices(step).tolist()
            seen.extend(flat)
            step += 1
            if step in changes:  # registered after the previous step was handed out
                for sch in schedules:
                    sch.change(step, changes[step])
        assert step == (epoch + 1) * spe
        assert len(seen) == spe * B
        assert len(set(seen)) == len(seen), "an index appeared twice in one epoch"
        assert set(seen) <= set(range(N))
        assert N - len(set(seen)) == N % B  # only the remainder is dropped
        perm = plan.permutation(epoch)
        assert sorted(seen) == sorted(perm[: spe * B].tolist())
        assert set(range(N)) - set(seen) == set(perm[spe * B :].tolist())


# ---------------------------------------------------------------- split independence


@st.composite
def two_splits(draw):
    global_batch = draw(st.integers(1, 40))
    dataset_len = draw(st.integers(global_batch, 200))
    plan = GlobalPlan(dataset_len, global_batch, seed=draw(st.integers(0, 1000)))
    step = draw(st.integers(0, plan.steps_per_epoch * 3 - 1))
    n1 = draw(st.integers(1, min(global_batch, 8)))
    n2 = draw(st.integers(1, min(global_batch, 8)))
    return plan, step, draw(split(global_batch, n1)), draw(split(global_batch, n2))


@SETTINGS
@given(two_splits())
def test_step_samples_and_order_independent_of_workers_and_split(case):
    plan, step, a, b = case
    single = plan.worker_indices(step, [plan.global_batch], 0)
    assert len(single) == plan.global_batch
    assert concat(plan, step, a) == single
    assert concat(plan, step, b) == single
    # contiguous slices: worker r starts where worker r-1 ended
    starts = np.cumsum([0, *a[:-1]])
    for r, (s0, br) in enumerate(zip(starts, a)):
        assert plan.worker_indices(step, a, r) == single[s0 : s0 + br]


def test_worker_slices_hand_example():
    plan = GlobalPlan(10, 6, seed=3)
    perm = plan.permutation(0).tolist()
    assert plan.worker_indices(0, [1, 2, 3], 0) == perm[0:1]
    assert plan.worker_indices(0, [1, 2, 3], 1) == perm[1:3]
    assert plan.worker_indices(0, [1, 2, 3], 2) == perm[3:6]
    # steps_per_epoch == 1: step 1 is epoch 1's first batch
    assert plan.worker_indices(1, [6], 0) == plan.permutation(1).tolist()[0:6]


# ---------------------------------------------------------------- permutations


@SETTINGS
@given(st.integers(20, 300), st.integers(0, 2**31), st.integers(0, 50), st.integers(1, 50))
def test_permutation_seeded_per_epoch(n, seed, epoch, delta):
    p1 = GlobalPlan(n, 1, seed=seed).permutation(epoch)
    p2 = GlobalPlan(n, 1, seed=seed).permutation(epoch)
    assert sorted(p1.tolist()) == list(range(n))
    np.testing.assert_array_equal(p1, p2)
    assert not np.array_equal(p1, GlobalPlan(n, 1, seed=seed).permutation(epoch + delta))
    assert not np.array_equal(p1, GlobalPlan(n, 1, seed=seed + delta).permutation(epoch))


# ---------------------------------------------------------------- validation


@SETTINGS
@given(st.integers(1, 100), st.integers(1, 100))
def test_plan_rejects_dataset_smaller_than_global_batch(n, extra):
    with pytest.raises(ValueError, match="global batch"):
        GlobalPlan(n, n + extra)
    assert GlobalPlan(n, n).steps_per_epoch == 1  # exactly one batch is fine


@pytest.mark.parametrize("bad_batch", [0, -3])
def test_plan_rejects_non_positive_global_batch(bad_batch):
    with pytest.raises(ValueError):
        GlobalPlan(10, bad_batch)


@SETTINGS
@given(st.integers(2, 30), st.data())
def test_worker_indices_rejects_batches_not_summing_to_b(B, data):
    plan = GlobalPlan(B * 2, B)
    n = data.draw(st.integers(1, min(B, 5)))
    good = list(data.draw(split(B, n)))
    off = data.draw(st.integers(-good[-1], 5).filter(lambda d: d != 0))
    bad = good[:-1] + [good[-1] + off]
    for r in range(n):
        with pytest.raises(ValueError, match="sum"):
            plan.worker_indices(0, bad, r)


def test_schedule_refuses_read_step_and_non_increasing_changes():
    sch = BatchSchedule((4, 4))
    assert sch.at(0) == (4, 4)
    assert sch.at(5) == (4, 4)
    with pytest.raises(RuntimeError):
        sch.change(5, (2, 6))  # already handed out
    with pytest.raises(RuntimeError):
        sch.change(2, (2, 6))
    sch.change(6, (2, 6))
    with pytest.raises(RuntimeError):
        sch.change(6, (3, 5))  # same step again
    sch.change(9, (3, 5))
    with pytest.raises(RuntimeError):
        sch.change(8, (1, 7))  # moving backwards
    assert [sch.at(s) for s in (5, 6, 8, 9, 100)] == [(4, 4), (2, 6), (2, 6), (3, 5), (3, 5)]


def test_a_hold_decides_before_any_plan_past_its_limit_is_read():
    """A meeting is read a step after it starts; a loop that samples further ahead meanwhile (a new epoch's
    prefetch) makes the pending decision land first, so the change is in force for the step it now reads."""
    sch, ran = BatchSchedule((4, 4)), []

    def decide():
        ran.append(sch.last_read)
        sch.change(7, (2, 6))

    assert sch.at(5) == (4, 4)
    sch.hold(6, decide)
    assert sch.at(6) == (4, 4) and ran == []  # within the limit: no wait
    assert sch.at(7) == (2, 6) and ran == [6]  # past it: decided first, the change in force
    assert sch.at(8) == (2, 6) and ran == [6]  # once
    sch.hold(9, decide)
    sch.hold(None)  # read at the step (or dropped at release): nothing runs later
    sch.at(20)
    assert ran == [6]


@SETTINGS
@given(st.lists(st.integers(1, 5), min_size=0, max_size=10), st.integers(0, 80))
def test_schedule_at_matches_reference(gaps, probe):
    starts = list(np.cumsum(gaps)) if gaps else []
    sch = BatchSchedule((1,))
    for k, s in enumerate(starts):
        sch.change(int(s), (k + 2,))
    expected = (1,)
    for k, s in enumerate(starts):
        if s <= probe:
            expected = (k + 2,)
    assert sch.at(probe) == expected
    with pytest.raises(RuntimeError):
        sch.change(probe, (99,))  # probe has now been read


# ---------------------------------------------------------------- DataLoader


def _loader(plan, schedule, rank, num_workers, steps=None, **kw):
    ds = TensorDataset(torch.arange(plan.dataset_len))
    sampler = VariableBatchSampler(plan, schedule, rank, steps=steps)
    if num_workers:
        kw.setdefault("prefetch_factor", 2)
    return sampler, DataLoader(ds, batch_sampler=sampler, num_workers=num_workers, **kw)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dataloader_runtime_changes_ahead_of_prefetch(num_workers):
    plan = GlobalPlan(97, 12, seed=7)  # 8 steps per epoch, 1 dropped
    ranks, prefetch = 3, 2
    ahead = num_workers * prefetch + 1
    initial = (4, 4, 4)
    changes: dict[int, tuple[int, ...]] = {}
    got: dict[int, list[list[int]]] = {s: [] for s in range(plan.steps_per_epoch)}
    for rank in range(ranks):
        rng = np.random.default_rng(0)  # same decisions on every rank
        schedule = BatchSchedule(initial)
        sampler, loader = _loader(plan, schedule, rank, num_workers)
        for step, (x,) in enumerate(loader):
            got[step].append(x.tolist())
            if num_workers and step + 1 < plan.steps_per_epoch:
                with pytest.raises(RuntimeError):
                    schedule.change(step + 1, (1, 1, 10))  # already prefetched
            target = step + ahead
            if target < plan.steps_per_epoch:
                cuts = np.sort(rng.choice(np.arange(1, 12), size=2, replace=False))
                b = (int(cuts[0]), int(cuts[1] - cuts[0]), int(12 - cuts[1]))
                schedule.change(target, b)
                if rank == 0:
                    changes[target] = b
        assert step == plan.steps_per_epoch - 1
    assert len(changes) >= 2
    in_force = initial
    seen = []
    for step in range(plan.steps_per_epoch):
        in_force = changes.get(step, in_force)
        for rank in range(ranks):
            assert got[step][rank] == plan.worker_indices(step, in_force, rank)
        flat = [i for part in got[step] for i in part]
        assert flat == plan.step_indices(step).tolist()
        seen += flat
    assert len(set(seen)) == len(seen) == 96


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dataloader_total_steps_across_epochs(num_workers):
    plan = GlobalPlan(23, 5, seed=1)  # 4 steps per epoch
    schedule = BatchSchedule((2, 3))
    kw = {"persistent_workers": True} if num_workers else {}
    sampler, loader = _loader(plan, schedule, 1, num_workers, steps=10, **kw)
    lengths, step = [], 0
    for epoch in range(4):
        sampler.set_epoch(epoch)
        lengths.append(len(sampler))
        n = 0
        for (x,) in loader:
            assert x.tolist() == plan.worker_indices(step, (2, 3), 1)
            step, n = step + 1, n + 1
        assert n == len(sampler) == len(loader)
    assert lengths == [4, 4, 2, 0]
    assert step == 10


@SETTINGS
@given(st.integers(1, 60), st.integers(1, 60), st.one_of(st.none(), st.integers(0, 200)), st.integers(0, 8))
def test_sampler_len_and_steps(B, extra, total, epoch):
    plan = GlobalPlan(B + extra, B)
    sampler = VariableBatchSampler(plan, BatchSchedule((B,)), 0, steps=total)
    sampler.set_epoch(epoch)
    spe = plan.steps_per_epoch
    batches = list(sampler)
    first = epoch * spe
    expected = spe if total is None else max(0, min(spe, total - first))
    assert len(sampler) == len(batches) == expected
    for k, b in enumerate(batches):
        assert b == plan.step_indices(first + k).tolist()


# ---------------------------------------------------------------- micro-batches


@SETTINGS
@given(st.integers(1, 500), st.integers(1, 40))
def test_micro_sizes_are_as_equal_as_possible_and_never_empty(batch, parts):
    if batch < parts:
        with pytest.raises(ValueError, match="non-empty"):
            micro_sizes(batch, parts)
        return
    sizes = micro_sizes(batch, parts)
    assert len(sizes) == parts and sum(sizes) == batch
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
    assert list(sizes) == sorted(sizes, reverse=True)


@SETTINGS
@given(st.integers(1, 4), st.data())
def test_micro_batches_concatenate_to_the_step_slice(k, data):
    B = data.draw(st.integers(3 * k, 40))
    plan = GlobalPlan(B * 3 + data.draw(st.integers(0, 5)), B, seed=data.draw(st.integers(0, 99)))
    batches = data.draw(split(B, 3).filter(lambda b: min(b) >= k))
    for rank in range(3):
        sampler = VariableBatchSampler(plan, BatchSchedule(batches), rank, micro_steps=k)
        lists = list(sampler)
        assert len(lists) == len(sampler) == plan.steps_per_epoch * k
        for step in range(plan.steps_per_epoch):
            parts = lists[step * k : (step + 1) * k]
            assert [len(p) for p in parts] == list(micro_sizes(batches[rank], k))
            assert [i for p in parts for i in p] == plan.worker_indices(step, batches, rank)


# ---------------------------------------------------------------- the sampler's place


def test_set_epoch_moves_forward_only_and_says_so():
    plan = GlobalPlan(40, 8)  # 5 steps per epoch
    sampler = VariableBatchSampler(plan, BatchSchedule((8,)), 0)
    sampler.complete(2)
    assert (sampler.epoch, sampler.offset) == (0, 3) and sampler.steps() == range(3, 5)
    sampler.set_epoch(0)  # the current epoch: no change
    assert sampler.steps() == range(3, 5)
    sampler.set_epoch(2)
    assert sampler.steps() == range(10, 15)
    with pytest.raises(RuntimeError, match=r"set_epoch\(1\).*already at epoch 2"):
        sampler.set_epoch(1)
    sampler.complete(14)  # the last step of epoch 2
    assert (sampler.epoch, sampler.offset) == (3, 0)
    sampler.complete(11)  # never moves back
    assert (sampler.epoch, sampler.offset) == (3, 0)
    sampler.end_epoch(2)
    assert (sampler.epoch, sampler.offset) == (3, 0)
    sampler.end_epoch(3)
    assert (sampler.epoch, sampler.offset) == (4, 0)


def test_sampler_and_schedule_state_round_trip():
    plan = GlobalPlan(50, 10, seed=4)
    schedule = BatchSchedule((5, 5))
    sampler = VariableBatchSampler(plan, schedule, 1)
    sampler.complete(6)
    schedule.at(6)
    schedule.change(8, (3, 7))
    other_schedule = BatchSchedule((5, 5))
    other = VariableBatchSampler(None, other_schedule, 1)  # the place exists before the dataset
    other.load_state_dict(sampler.state_dict())
    other_schedule.load_state_dict(schedule.state_dict())
    assert other.state_dict() == sampler.state_dict() and other_schedule.state_dict() == schedule.state_dict()
    other.use_plan(plan)
    assert list(other) == list(sampler)
    assert other_schedule.last_read == 9  # reading is not state: it restarts with the new process
    with pytest.raises(ValueError, match="2 workers loaded into one for 3"):
        BatchSchedule((1, 1, 1)).load_state_dict(schedule.state_dict())


# ---------------------------------------------------------------- BalancedLoader


def _balanced(n=30, B=6, k=1, batches=(2, 4), rank=1):
    plan = GlobalPlan(n, B, seed=2)  # 5 steps per epoch
    sampler = VariableBatchSampler(plan, BatchSchedule(batches), rank, micro_steps=k)
    ds = TensorDataset(torch.arange(n))
    handed: list[tuple[int, bool]] = []
    loader = BalancedLoader(DataLoader(ds, batch_sampler=sampler), sampler, lambda s, r: handed.append((s, r)), k)
    return plan, sampler, loader, handed


def test_loader_habits_dataset_sampler_len_and_micro_lists():
    plan, sampler, loader, handed = _balanced(k=2)
    assert loader.dataset is loader.loader.dataset and loader.sampler is sampler and len(loader) == 5
    items = list(loader)
    assert [s for s, _ in handed] == [0, 1, 2, 3, 4]
    assert all(isinstance(item, list) and len(item) == 2 for item in items)
    assert [i for (x,) in items[3] for i in x.tolist()] == plan.worker_indices(3, (2, 4), 1)
    assert loader.epoch == 1  # ran through: the next iteration is the next epoch


def test_a_peek_is_served_again_and_a_break_continues_where_reports_ended():
    plan, sampler, loader, handed = _balanced()
    (peeked,) = next(iter(loader))
    it = iter(loader)
    assert next(it)[0].tolist() == peeked.tolist() == plan.worker_indices(0, (2, 4), 1)
    assert handed == [(0, False), (0, True)]  # the second hand-out of step 0 restarts
    sampler.complete(0)
    next(it)
    sampler.complete(1)  # steps 0 and 1 reported, then the loop breaks
    assert [s for s, _ in handed[2:]] == [1]
    rest = [x.tolist() for (x,) in loader]
    assert rest == [plan.worker_indices(s, (2, 4), 1) for s in (2, 3, 4)]
    loader.set_epoch(3)
    assert next(iter(loader))[0].tolist() == plan.worker_indices(15, (2, 4), 1)
    with pytest.raises(RuntimeError, match="already at epoch 3"):
        loader.sampler.set_epoch(2)


def test_a_replaced_iterator_refuses_to_go_on():
    _, _, loader, _ = _balanced()
    old = iter(loader)
    next(old)
    iter(loader)
    with pytest.raises(RuntimeError, match="replaced by a newer iter"):
        next(old)

"""The hot path's size, counted: ``ol.step()`` and the loader's hand-out on a step that ends no window.

Issue 33: OmniLearn must cost (almost) nothing per step where there is
nothing to balance. Time is what matters, but a test that times is a flaky
test; so this counts the Python calls a step makes (``sys.setprofile``: every
Python function entered, and every C function called from Python) on steps
that end no window and start no meeting, and holds them to a budget, the
same at the run's start and 1,000 steps later (O(1): nothing grows with the
steps done). The loader's hand-out is counted against a plain ``DataLoader``
over the same data and batch: what it adds beyond ``DataLoader``'s own work.
A change that adds work to every step fails here and says how much; the
budgets are what a step makes today with a little room.

Run: ``python -m pytest -q tests/unit/test_step_cost.py``
"""

from __future__ import annotations

import sys

import torch
from torch import nn

import omnilearn

STEP_BUDGET = 24  # Python and C calls of a quiet step's ol.step(): 21 on 2026-11-28 (27 the day before, 37 before issue 33)
FETCH_BUDGET = 0  # calls the hand-out adds to a plain DataLoader's next(): -6 on 2026-11-28 (15 the day before, 28 before
# issue 33): OmniLearn's sampler hands out a step's slice in fewer calls than a RandomSampler's BatchSampler


class Rows(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4096

    def __getitem__(self, i: int):
        return torch.full((4,), float(i)), i % 3


def _forever(loader):
    while True:
        yield from loader


def _calls(fn) -> int:
    count = 0

    def profile(frame, event, arg):
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


def test_a_quiet_step_makes_a_bounded_number_of_calls_at_its_start_and_1000_steps_later():
    plain = iter(torch.utils.data.DataLoader(Rows(), batch_size=32, shuffle=True))
    next(plain)
    plain_fetch = min(_calls(lambda: next(plain)) for _ in range(5))
    ol = omnilearn.setup(global_batch=32, control_interval=15, total_steps=1100, handle_signals=False,
                         device="cpu")
    model = ol.wrap_model(nn.Linear(4, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = ol.data_loader(Rows())
    counts: dict[int, list[int]] = {}
    it = _forever(loader)
    step = 0
    while step < 1050:
        batch = [None]
        quiet = step % 15 not in (0, 4, 5, 9, 10, 14)  # no window meeting starts or is read at this step
        fetch = _calls(lambda: batch.__setitem__(0, next(it))) if quiet else (batch.__setitem__(0, next(it)), 0)[1]
        x, y = batch[0]
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        calls = _calls(lambda: ol.step(loss)) if quiet else (ol.step(loss), 0)[1]
        if quiet and (20 <= step < 30 or 1020 <= step < 1030):
            counts[step] = [fetch, calls]
        step += 1
    ol.finish()
    said = f"calls per quiet step (hand-out, ol.step): {counts}; a plain DataLoader's next(): {plain_fetch}"
    assert max(c[1] for c in counts.values()) <= STEP_BUDGET, said
    assert max(c[0] for c in counts.values()) - plain_fetch <= FETCH_BUDGET, said
    early = [sum(c) for s, c in counts.items() if s < 100]
    late = [sum(c) for s, c in counts.items() if s >= 100]
    assert max(late) <= max(early), f"later steps make more calls than early ones: {said} (something grows)"

"""A restored ControlLoop decides bit for bit alike (issue 20, item 7).

What is checked:

- a scripted run (3 workers; a memory knee that teaches rank 0 a cap; a
  change whose measured step got slower, taken back and held; a slow worker
  pinned at ``min_batch``) restored at EVERY window, through
  ``torch.save``/``torch.load(weights_only=True)`` into a fresh loop built
  the same way, takes the same next 5 decisions as the original (decision,
  caps, pinned worker); the run passes through a cut mid-hold with a learned
  cap and through cuts where the pin counter is part-way (asserted, so the
  test cannot pass vacuously). A hold, a pin run and a learned cap never
  coexist at one cut: the change that a hold takes back is only made by a
  decision where no worker is pinned (a pinned slowest worker leaves no gain);
- the same over random scripts and cut points (hypothesis: 2-4 workers, both
  adaptive controllers, knees, noisy windows, reported caps, speed shifts);
- the generic guard: after a round trip every attribute of the fresh loop,
  walked recursively (caps, step guard, pin watch, controller), equals the
  original's, so a new counter that ``state_dict`` forgets fails here;
- a state without the newer keys (an older checkpoint) still loads: the
  guard and pin watch keep their defaults, a learned cap keeps a full term.

Run: ``cd /work/main && python -m pytest -q tests/unit/test_loop_state.py``
"""

from __future__ import annotations

import io
import json
import math

import numpy as np
import torch
from hypothesis import given, settings, strategies as st

from omnilearn.balance.allocation import Bounds
from omnilearn.balance.controllers import ModelController, ProportionalController
from omnilearn.balance.guards import LEARNED_WINDOWS
from omnilearn.balance.loop import PIN_WINDOWS, ControlLoop

NEXT = 5  # decisions compared after each restore


def round_trip(state: dict) -> dict:
    """Through bytes as a checkpoint holds it: ``torch.save``, then ``torch.load(weights_only=True)``; the
    state is strict JSON without null (no NaN, no None: what every checkpoint format holds)."""
    assert "null" not in json.dumps(state, allow_nan=False)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def canon(value):
    """Plain, comparable form of an object graph: arrays as lists, NaN as "nan", objects as their attributes."""
    if isinstance(value, np.ndarray):
        return canon(value.tolist())
    if isinstance(value, (float, np.floating)):
        return "nan" if math.isnan(value) else float(value)
    if isinstance(value, (list, tuple)):
        return [canon(v) for v in value]
    if isinstance(value, dict):
        return {k: canon(v) for k, v in value.items()}
    if hasattr(value, "__dict__"):
        return {"type": type(value).__name__, **{k: canon(v) for k, v in vars(value).items()}}
    return value


def differences(a, b, path: str = "loop") -> list[str]:
    """The attribute paths where two :func:`canon` forms differ."""
    if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
        return [p for k in a for p in differences(a[k], b[k], f"{path}.{k}")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"[:300]]


# ------------------------------------------------------------------ the scripted run

def scripted_loop() -> ControlLoop:
    return ControlLoop(ProportionalController(Bounds(96, 3, 8)), history=4, min_samples=10)


def scripted_window(loop: ControlLoop, k: int) -> dict:
    """Window ``k`` of the scripted run: ranks 0, 1 at 100 samples/s (rank 0 at half above 40 samples: a
    memory knee), rank 2 at 4 samples/s; 5 samples per window; the measured step jumps 50% at window 6."""
    plan = loop.plan
    times = plan / np.array([100.0, 100.0, 4.0])
    times[0] *= 2.0 if plan[0] > 40 else 1.0
    step_s = (float(times.max()) + 0.1) * (1.5 if k == 6 else 1.0)
    return {"step": 15 * k, "rows": [(b, 5, t, 0.01 * t) for b, t in zip(plan, times)], "step_s": [step_s] * 3}


def outcome(loop: ControlLoop, window: dict) -> tuple:
    """One update, and what it left that a later step sees: the decision, the caps, the pinned worker."""
    d = loop.update(window["step"], window["rows"], caps=window.get("caps"), step_s=window["step_s"])
    caps = None if loop.caps is None else loop.caps.bounds_now().caps().tolist()
    return d, caps, loop.pinned


def restored(loop: ControlLoop, build) -> ControlLoop:
    twin = build()
    twin.load_state_dict(round_trip(loop.state_dict()))
    return twin


def run_to(cut: int) -> ControlLoop:
    loop = scripted_loop()
    for k in range(cut):
        outcome(loop, scripted_window(loop, k))
    return loop


def next_decisions_alike(loop: ControlLoop, twin: ControlLoop, cut: int) -> list[tuple]:
    """Drive both through windows ``cut`` .. ``cut + NEXT - 1``; the original's outcomes."""
    ahead = []
    for k in range(cut, cut + NEXT):
        original, again = outcome(loop, scripted_window(loop, k)), outcome(twin, scripted_window(twin, k))
        assert again == original, f"restored after window {cut - 1}: window {k} gave {again}, not {original}"
        ahead.append(original)
    return ahead


def test_a_loop_restored_mid_hold_with_a_learned_cap_takes_the_same_next_five_decisions():
    loop = run_to(7)
    assert loop.guard.holding == 4 and loop.caps.bounds_now().caps().tolist() == [32, 96, 96]  # the state named
    ahead = next_decisions_alike(loop, restored(loop, scripted_loop), 7)
    assert [d.changed for d, *_ in ahead] == [False, False, False, True, False]  # held, then a change, capped


def test_a_loop_restored_at_every_window_takes_the_same_next_five_decisions():
    mid_hold, pin_part_way = [], []
    for cut in range(20 - NEXT):
        loop = run_to(cut)
        if loop.guard.holding and (loop.caps.learned < loop.caps.bounds.global_batch).any():
            mid_hold.append(cut)
        pinned_at_cut = loop.pinned
        ahead = next_decisions_alike(loop, restored(loop, scripted_loop), cut)
        # named within PIN_WINDOWS - 1 updates of the cut: its counter had started before it
        if pinned_at_cut is None and any(p is not None for *_, p in ahead[:PIN_WINDOWS - 1]):
            pin_part_way.append(cut)
    assert mid_hold and pin_part_way, (mid_hold, pin_part_way)  # the run passed through both states


# ------------------------------------------------------------------ random scripts

@st.composite
def scripts(draw):
    n = draw(st.integers(2, 4))
    lo = draw(st.sampled_from([1, 4, 8]))
    total = draw(st.integers(n * lo + n, 32 * n))
    kind = draw(st.sampled_from(["omnilearn", "model"]))
    history, min_samples = draw(st.integers(2, 5)), draw(st.integers(1, 8))
    return n, total, lo, kind, history, min_samples, draw(st.integers(0, 2**31)), draw(st.integers(2, 24))


def random_loop(n, total, lo, kind, history, min_samples) -> ControlLoop:
    cls = ModelController if kind == "model" else ProportionalController
    return ControlLoop(cls(Bounds(total, n, lo)), history=history, min_samples=min_samples, lag=1)


def random_window(loop: ControlLoop, seed: int, k: int) -> dict:
    """A noisy window from per-worker affine times with a memory knee, a measured step 40% slower at some
    plans, now and then a reported cap, one speed shift (all from ``seed``, ``k`` and the plan: both loops
    see the same script)."""
    setup, rng = np.random.default_rng(seed), np.random.default_rng([seed, k])
    n = loop.workers
    alpha, beta = setup.uniform(0.0, 0.05, n), setup.uniform(1e-3, 2e-2, n)
    share = loop.plan.sum() // n
    knee = share + setup.integers(0, share + 1, n)  # above it a worker's samples/s fall (memory pressure)
    beta = beta * np.where(np.arange(n) == setup.integers(n), 3.0, 1.0) if k >= setup.integers(4, 20) else beta
    t = (alpha + beta * loop.plan) * np.where(loop.plan > knee, 2.5, 1.0)
    count = rng.integers(1, 7)
    samples = t[:, None] * (1 + 0.05 * rng.standard_normal((n, count)))
    rows = [(b, count, float(np.median(s)), float(np.std(s))) for b, s in zip(loop.plan, samples)]
    slow_plan = np.random.default_rng([seed, *loop.plan.tolist()]).random() < 0.4  # neighbours interfere
    step_s = float(t.max()) * (1.4 if slow_plan else 1.0)
    caps = [int(rng.integers(loop.plan.sum() // n, loop.plan.sum() + 1)) if rng.random() < 0.03 else 0
            for _ in range(n)]
    return {"step": 10 * k, "rows": rows, "step_s": [step_s] * n, "caps": caps}


@settings(max_examples=60, deadline=None)
@given(script=scripts())
def test_random_scripts_restored_anywhere_decide_alike(script):
    *shape, seed, cut = script
    loop = random_loop(*shape)
    for k in range(cut):
        outcome(loop, random_window(loop, seed, k))
    twin = restored(loop, lambda: random_loop(*shape))
    for k in range(cut, cut + NEXT):
        assert outcome(twin, random_window(twin, seed, k)) == outcome(loop, random_window(loop, seed, k))


def test_every_attribute_that_changed_is_restored():
    """The generic guard: any attribute that differs from a fresh loop's after a round trip was not saved."""
    loop, fresh = scripted_loop(), canon(scripted_loop())
    changed: set[str] = set()
    for k in range(14):
        outcome(loop, scripted_window(loop, k))
        changed |= {p.split(":")[0] for p in differences(canon(loop), fresh)}
        twin = restored(loop, scripted_loop)
        assert not differences(canon(twin), canon(loop)), f"after window {k}: {differences(canon(twin), canon(loop))}"
    # the walk reached the nested state that a resume used to lose
    for path in ("loop.caps.lapse", "loop.caps.last", "loop.guard.holding", "loop.guard.before", "loop.guard.steps"):
        assert any(p.startswith(path) for p in changed), (path, sorted(changed))


def test_a_state_without_the_newer_keys_still_loads_with_defaults():
    loop = run_to(7)  # mid-hold, rank 0 capped at 32 by what it learned
    state = round_trip(loop.state_dict())
    state.pop("guard"), state.pop("pin"), state["caps"].pop("lapse"), state["caps"].pop("last")
    twin = scripted_loop()
    twin.load_state_dict(state)
    assert twin.guard.holding == 0 and twin.pinned is None and twin.batches == loop.batches
    assert twin.caps.lapse.tolist() == [LEARNED_WINDOWS, 0, 0]  # its learned cap (age unknown): a full term
    assert twin.caps.bounds_now().caps().tolist() == [32, 96, 96]

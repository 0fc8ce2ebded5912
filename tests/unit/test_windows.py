"""Random-window sampling (:mod:`omnilearn.data.windows`): one seeded draw of ``B`` per step, sliced by the plan.

- the ranks' slices, concatenated, are the one-worker draw whatever the split (the global batch is defined
  without the workers);
- draws cost O(B): no permutation of the range is made;
- ``Session.random_indices`` hands out micro-batches, resumes at a checkpoint's step with the same draws,
  and refuses a second data source or a changed range.

Run: ``python -m pytest -q tests/unit/test_windows.py``
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st
from torch import nn

import omnilearn
from omnilearn.config import ConfigError
from omnilearn.data.plan import BatchSchedule, VariableBatchSampler
from omnilearn.data.windows import WindowPlan


@given(step=st.integers(0, 10**6), cut=st.lists(st.integers(1, 20), min_size=1, max_size=6))
def test_the_ranks_slices_are_the_one_worker_draw(step, cut):
    batch = sum(cut)
    plan = WindowPlan(10**12, batch, seed=3)  # a huge range: no permutation could be made of it
    whole = plan.worker_indices(step, (batch,), 0)
    parts = [plan.worker_indices(step, tuple(cut), r) for r in range(len(cut))]
    assert sum(parts, []) == whole and all(0 <= i < 10**12 for i in whole)
    assert plan.permutation(0) is None


def test_steps_draw_differently_and_reproducibly():
    plan = WindowPlan(1000, 64, seed=0)
    assert plan.step_indices(5).tolist() == WindowPlan(1000, 64, seed=0).step_indices(5).tolist()
    assert plan.step_indices(5).tolist() != plan.step_indices(6).tolist()
    assert plan.step_indices(5).tolist() != WindowPlan(1000, 64, seed=1).step_indices(5).tolist()


def test_micro_batches_cut_the_rank_slice_in_order():
    plan = WindowPlan(500, 12, seed=0)
    sampler = VariableBatchSampler(plan, BatchSchedule((7, 5)), rank=0, steps=2, micro_steps=3)
    lists = list(sampler)
    assert [len(x) for x in lists] == [3, 2, 2] * 2
    assert sum(lists[:3], []) == plan.worker_indices(0, (7, 5), 0)


def _draw(ol, steps, model=None):
    model = model or ol.wrap_model(nn.Linear(3, 1))
    out = []
    for _ in range(steps):
        micro = [ol.random_indices(90) for _ in range(ol.cfg.accumulation_steps)]
        for ix in micro:
            ol.backward(model(torch.ones(len(ix), 3)).mean())
        ol.step()
        out.append(torch.cat(micro).tolist())
    return out


def test_session_draws_micro_batches_and_resumes_at_the_same_draws(tmp_path):
    settings = dict(global_batch=8, accumulation_steps=2, device="cpu", total_steps=12)
    full = _draw(omnilearn.setup(**settings), 12)
    assert full[0] == WindowPlan(90, 8, 0).step_indices(0).tolist()
    first = omnilearn.setup(**settings)
    _draw(first, 5)
    first.save_checkpoint(tmp_path)
    again = omnilearn.setup(**settings)
    model = again.wrap_model(nn.Linear(3, 1))
    assert again.load_checkpoint(tmp_path)
    assert _draw(again, 7, model) == full[5:]


def test_one_data_source_and_one_range():
    ol = omnilearn.setup(global_batch=8, device="cpu")
    with pytest.raises(ConfigError, match="high must be a positive int"):
        ol.random_indices(0)
    ol.random_indices(50)
    with pytest.raises(ConfigError, match=r"random_indices\(60\) after random_indices\(50\)"):
        ol.random_indices(60)
    with pytest.raises(RuntimeError, match="one training data source per session"):
        ol.data_loader(list(range(100)))

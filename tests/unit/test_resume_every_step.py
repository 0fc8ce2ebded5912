"""A resume at every step lands on the uninterrupted path: the core API, one process, float64.

A user's loop (tests/resumeloop.py: ``omnilearn.setup``, ``wrap_model``, ``data_loader`` with ``set_epoch``, SGD
with momentum, a per-step LR schedule, ``ol.save_checkpoint`` / ``ol.load_checkpoint``) of 3 epochs of 6 steps.
For every step k from 1 to 17 (inside an epoch, at each epoch boundary, one step before and after it, in the last
epoch): a session trains k steps and saves, a new session loads that checkpoint and trains to the end; its weights are
the uninterrupted run's, bitwise (one process: the same sums in the same order). At another worker count
(every step, <= 1e-12): tests/dist/test_resume_every_step_elastic.py.

Run: ``python -m pytest -q tests/unit/test_resume_every_step.py``
"""

from __future__ import annotations

import pytest
import torch
from resumeloop import STEPS, train


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> dict[str, torch.Tensor]:
    return train()


@pytest.mark.parametrize("k", range(1, STEPS))
def test_a_resume_after_step_k_ends_with_the_uninterrupted_weights(whole, tmp_path, k):
    train(save_to=tmp_path, stop_at=k)
    resumed = train(resume_from=tmp_path / str(k))
    assert resumed.keys() == whole.keys()
    for name in whole:
        assert torch.equal(resumed[name], whole[name]), (k, name, float((resumed[name] - whole[name]).abs().max()))

"""``IterableDataset`` streams (:mod:`omnilearn.data.stream`): each step takes this rank's ``b_i`` items, in order.

- a step's micro-batches are the next items of the stream, cut as the map-style path cuts them;
- a stream that runs dry is reopened (``set_epoch`` first) and the run goes on;
- a resumed run skips exactly the items the checkpoint's steps trained on;
- no ``total_steps``: a one-line error naming the keyword.
The two-rank run (uneven batches in lockstep) is in ``tests/dist/test_api.py``.

Run: ``python -m pytest -q tests/unit/test_streams.py``
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import IterableDataset

import omnilearn
from omnilearn.config import ConfigError


class Numbers(IterableDataset):
    """0, 1, ..., n-1 as (x, y) pairs; ``set_epoch`` is recorded."""

    def __init__(self, n: int) -> None:
        self.n, self.epochs = n, []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def __iter__(self):
        return ((torch.tensor([float(i)]), torch.tensor(i)) for i in range(self.n))


def _run(ol, loader, steps=None):
    model = ol.wrap_model(nn.Linear(1, 1))
    seen = []
    for k, batch in enumerate(loader):
        micro = batch if ol.cfg.accumulation_steps > 1 else [batch]
        for x, y in micro:
            ol.backward(model(x).mean())
            seen.append(y.tolist())
        ol.step()
        if steps is not None and k + 1 == steps:
            break
    return seen


def test_steps_take_the_next_items_in_micro_batches():
    ol = omnilearn.setup(global_batch=6, accumulation_steps=2, total_steps=4, device="cpu")
    seen = _run(ol, ol.data_loader(Numbers(1000)))
    assert seen == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11], [12, 13, 14], [15, 16, 17], [18, 19, 20],
                    [21, 22, 23]]


def test_a_dry_stream_is_reopened():
    data = Numbers(10)
    ol = omnilearn.setup(global_batch=4, total_steps=6, device="cpu")
    seen = _run(ol, ol.data_loader(data))
    assert sum(seen, []) == (list(range(10)) * 3)[:24] and data.epochs == [1, 2]


def test_resume_skips_what_the_checkpoint_trained_on(tmp_path):
    first = omnilearn.setup(global_batch=4, total_steps=8, device="cpu")
    assert _run(first, first.data_loader(Numbers(100)), steps=3) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    first.save_checkpoint(tmp_path)
    again = omnilearn.setup(global_batch=4, total_steps=8, device="cpu")
    loader = again.data_loader(Numbers(100))
    again.wrap_model(nn.Linear(1, 1))
    assert again.load_checkpoint(tmp_path)
    model = again.model
    seen = []
    for x, y in loader:
        again.backward(model(x).mean())
        again.step()
        seen.append(y.tolist())
    assert seen[0] == [12, 13, 14, 15] and len(seen) == 5


def test_a_stream_needs_total_steps():
    ol = omnilearn.setup(global_batch=4, device="cpu")
    with pytest.raises(ConfigError, match=r"pass total_steps=N to omnilearn.setup\(\)") as e:
        ol.data_loader(Numbers(10))
    assert "\n" not in str(e.value)

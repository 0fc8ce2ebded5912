"""A resume that would read other samples at the saved data position is refused in one line (one process).

The session state holds what its data position means (:func:`omnilearn.data.position.basis`: seed, dataset
length, global batch, steps per epoch, the partial-batch policy); loading it into a session with another seed,
dataset or batch raises :class:`~omnilearn.config.ConfigError` naming the saved value, the value now and the
``omnilearn.setup`` keyword (not only a CLI flag), through ``load_state_dict`` and through
``load_checkpoint`` (before the model changes), and when the dataset comes after the load (at
``data_loader``). A state from before the basis was saved loads with a warning. Streams check only the batch
(a longer run is a legitimate resume).

Run: ``python -m pytest -q tests/unit/test_resume_checks.py``
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import omnilearn
from omnilearn.bsp.checkpointing import UnverifiedResumeWarning
from omnilearn.config import ConfigError
from omnilearn.data.position import basis, mismatch
from omnilearn.data.schedule import GlobalPlan
from omnilearn.data.stream import StreamPlan
from omnilearn.data.windows import WindowPlan


class Data(torch.utils.data.Dataset):
    def __init__(self, n: int = 96) -> None:
        self.x, self.y = torch.randn(n, 4), torch.randint(2, (n,))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def session(n: int = 96, **kw):
    ol = omnilearn.setup(**{"global_batch": 16, "control_interval": 4, "device": "cpu", **kw})
    model = ol.wrap_model(nn.Linear(4, 2))
    loader = ol.data_loader(Data(n))
    return ol, model, loader


def trained_state(steps: int = 3, **kw) -> dict:
    ol, model, loader = session(**kw)
    for i, (x, y) in enumerate(loader):
        nn.functional.cross_entropy(model(x), y).backward()
        ol.step()
        if i + 1 == steps:
            break
    state = ol.state_dict()
    ol.finish()
    return state


def refusal(state: dict, n: int = 96, **kw) -> str:
    other = session(n, **kw)[0]
    with pytest.raises(ConfigError) as info:
        other.load_state_dict(state)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_another_seed_is_refused_naming_both_and_the_keyword():
    message = refusal(trained_state(seed=0), seed=1)
    assert "saved with seed 0 but this run has seed 1" in message
    assert "seed=0 (omnilearn.setup keyword; omnilearn train --seed 0)" in message


def test_another_dataset_length_is_refused():
    message = refusal(trained_state(), n=80)
    assert "data size 96 but this run has data size 80" in message and "96 samples" in message


def test_another_dataset_length_with_the_same_epoch_length_is_refused_too():
    assert "data size 96 but this run has data size 100" in refusal(trained_state(), n=100)  # 6 steps per epoch both


def test_other_steps_per_epoch_are_refused():
    state = trained_state()
    state["data"]["steps_per_epoch"] = 5  # e.g. a version that kept an epoch's partial batch
    assert "steps per epoch 5 but this run has steps per epoch 6" in refusal(state)


def test_another_global_batch_names_the_keyword_not_only_the_flag():
    message = refusal(trained_state(), global_batch=32)
    assert "global batch 16 but this session has 32" in message and "global_batch=16 (omnilearn.setup" in message


def test_the_same_seed_and_data_resume_and_the_basis_is_saved():
    state = trained_state(seed=3)
    assert state["data"] == {"kind": "dataset", "global_batch": 16, "dataset_len": 96, "seed": 3,
                             "steps_per_epoch": 6, "partial_batch": "dropped"}
    other = session(seed=3)[0]
    other.load_state_dict(state)
    assert other.next_step == 3


def test_loaded_before_the_dataset_is_checked_when_it_comes():
    state = trained_state(seed=0)
    ol = omnilearn.setup(global_batch=16, control_interval=4, device="cpu", seed=0)
    ol.wrap_model(nn.Linear(4, 2))
    ol.load_state_dict(state)
    assert ol.state_dict()["data"] == state["data"]  # a save before the dataset keeps what the place means
    with pytest.raises(ConfigError, match="data size 96 but this run has data size 64"):
        ol.data_loader(Data(64))


def test_load_checkpoint_refuses_before_the_model_changes(tmp_path):
    ol, model, loader = session(seed=0)
    for x, y in loader:
        ol.step()
        break
    ol.save_checkpoint(tmp_path, model=model)
    ol.finish()
    other, other_model, _ = session(seed=5)
    before = [p.detach().clone() for p in other_model.parameters()]
    with pytest.raises(ConfigError, match="saved with seed 0 but this run has seed 5"):
        other.load_checkpoint(tmp_path, model=other_model)
    assert all(torch.equal(a, b) for a, b in zip(before, other_model.parameters()))


def test_a_state_without_the_basis_loads_with_a_warning():
    state = trained_state(seed=0)
    del state["data"]
    other = session(seed=1)[0]
    with pytest.warns(UnverifiedResumeWarning, match="cannot check"):
        other.load_state_dict(state)
    assert other.next_step == 3


def test_streams_check_the_batch_only_and_windows_the_range_and_seed():
    assert mismatch(basis(StreamPlan(160, 16, 0)), basis(StreamPlan(320, 16, 1))) is None  # a longer run
    assert "global batch 16" in mismatch(basis(StreamPlan(160, 16)), basis(StreamPlan(160, 32)))
    assert "seed 1 but this run has seed 2" in mismatch(basis(WindowPlan(500, 16, 1)), basis(WindowPlan(500, 16, 2)))
    assert "a stream" in mismatch(basis(StreamPlan(160, 16)), basis(GlobalPlan(160, 16)))
    assert mismatch(None, basis(GlobalPlan(160, 16))) is None and mismatch({}, basis(GlobalPlan(160, 16))) is None

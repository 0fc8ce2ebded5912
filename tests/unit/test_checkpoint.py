"""Checkpoint files (:mod:`omnilearn.checkpoint`) and the session's checkpoints in one process.

- The store keeps the newest K, writes atomically (a cut write is no
  checkpoint), verifies the checksum and falls back past a damaged newest
  one with a warning; files load with ``weights_only=True`` only.
- ``ol.save_checkpoint`` / ``ol.load_checkpoint``: a session resumed from a
  checkpoint goes on with the same weights as one never stopped, and
  returns False when there is nothing to load.
- The session is a ``Stateful``: ``torch.distributed.checkpoint`` saves and
  loads it beside the model.

Run: ``python -m pytest -q tests/unit/test_checkpoint.py``
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import omnilearn
from omnilearn.checkpoint import CheckpointError, CheckpointStore, CheckpointWarning


def state(v: float) -> dict:
    return {"w": torch.full((3,), v), "step": int(v), "name": "x", "nested": {"l": [1, 2.5, None]}}


def test_save_keeps_the_newest_and_loads_back(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    for step in (5, 10, 15):
        store.save(step, state(step))
    assert store.steps() == [10, 15]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000010.json", "step-000000010.pt",
                                                          "step-000000015.json", "step-000000015.pt"]
    step, loaded = store.load_latest()
    assert step == 15 and torch.equal(loaded["w"], torch.full((3,), 15.0)) and loaded["nested"]["l"] == [1, 2.5, None]


def test_a_damaged_newest_checkpoint_falls_back_with_a_warning(tmp_path):
    store = CheckpointStore(tmp_path, keep=3)
    store.save(1, state(1))
    store.save(2, state(2))
    data = bytearray(store.path(2).read_bytes())
    data[len(data) // 2] ^= 0xFF
    store.path(2).write_bytes(bytes(data))
    with pytest.warns(CheckpointWarning, match="step-000000002.pt is damaged: its checksum does not match"):
        step, loaded = store.load_latest()
    assert step == 1 and loaded["step"] == 1
    with pytest.raises(CheckpointError, match="damaged"):
        store.load(2)


def test_a_cut_write_is_not_a_checkpoint(tmp_path):
    store = CheckpointStore(tmp_path)
    store.save(1, state(1))
    store.path(2).write_bytes(b"half of a checkpoint")  # the .pt landed, its manifest never did
    assert store.steps() == [1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert store.load_latest()[0] == 1


def test_nothing_to_load(tmp_path):
    assert CheckpointStore(tmp_path / "none").load_latest() is None


def test_loading_refuses_code(tmp_path):
    """A checkpoint that pickles an arbitrary object is refused (weights_only), even with a valid checksum."""
    store = CheckpointStore(tmp_path)
    store.save(3, {"obj": CheckpointStore(tmp_path)})
    with pytest.warns(CheckpointWarning, match="cannot be loaded"):
        assert store.load_latest() is None


class Data(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(3)
        self.x, self.y = torch.randn(96, 5, generator=g), torch.randint(3, (96,), generator=g)

    def __len__(self) -> int:
        return 96

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def make(**kw):
    ol = omnilearn.setup(global_batch=16, control_interval=3, device="cpu", **kw)
    torch.manual_seed(0)
    model = ol.wrap_model(nn.Sequential(nn.Linear(5, 8), nn.Dropout(0.2), nn.Linear(8, 3)))
    loader = ol.data_loader(Data())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    return ol, model, loader, opt, sched


def run(ol, model, loader, opt, sched, epochs: int, stop_after: int | None = None, ckpt=None) -> None:
    done = 0
    for epoch in range(ol.epoch, epochs):
        loader.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            ol.backward(F.cross_entropy(model(x), y))
            opt.step()
            sched.step()
            ol.step()
            done += 1
            if done == stop_after:
                ol.save_checkpoint(ckpt, model=model, optimizer=opt, scheduler=sched, extra={"note": "mid"})
                return


def test_session_checkpoint_resumes_exactly(tmp_path):
    whole = make()
    run(*whole, epochs=3)
    first = make()
    assert not first[0].load_checkpoint(tmp_path, model=first[1], optimizer=first[3], scheduler=first[4])
    run(*first, epochs=3, stop_after=8, ckpt=tmp_path)  # mid-epoch (6 steps per epoch), mid-interval
    again = make()
    assert again[0].load_checkpoint(tmp_path, model=again[1], optimizer=again[3], scheduler=again[4])
    assert again[0].checkpoint_extra == {"note": "mid"} and again[0].next_step == 8 and again[0].epoch == 1
    run(*again, epochs=3)
    for a, b in zip(whole[1].state_dict().values(), again[1].state_dict().values()):
        assert torch.equal(a, b)
    assert whole[3].state_dict()["state"][0]["momentum_buffer"].equal(again[3].state_dict()["state"][0]["momentum_buffer"])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, no group: what DCP assumes
def test_session_is_stateful_for_dcp(tmp_path):
    import torch.distributed.checkpoint as dcp

    ol, model, loader, opt, sched = make()
    run(ol, model, loader, opt, sched, epochs=1)
    dcp.save({"session": ol, "model": model.state_dict()}, checkpoint_id=str(tmp_path / "dcp"))
    other = make()
    target = {"session": other[0], "model": other[1].state_dict()}
    dcp.load(target, checkpoint_id=str(tmp_path / "dcp"))
    other[1].load_state_dict(target["model"])
    assert other[0].next_step == ol.next_step == 6 and other[0].epoch == 1
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other[1].state_dict().values()))

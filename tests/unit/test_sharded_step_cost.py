"""An FSDP2 step's hand-out costs the same whatever the model's size: the gradient sync is set only on a change.

``set_requires_gradient_sync`` walks every module of the model (about 0.7 us each: 20 us for a tiny GPT, a
millisecond for a model of 1,500 modules); OmniLearn used to call it at every step's start. Now it is called
where a parameter group's flag differs: never on the steps of a run without micro-batches, twice a step (off
for the first micro-batch, on for the last) with them; and the hand-out makes as many calls for a model of 40
sharded layers as for one of 2. One process, a one-rank gloo group.

Run: ``python -m pytest -q tests/unit/test_sharded_step_cost.py``
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

import omnilearn

pytest.importorskip("torch.distributed.fsdp")


class Rows(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 1024

    def __getitem__(self, i: int):
        return torch.full((4,), float(i % 7)), i % 3


@pytest.fixture
def group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def sharded(layers: int) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(nn.Linear(4, 8), *[nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(layers)],
                          nn.Linear(8, 3))
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer)
    return fully_shard(model)


def run(layers: int, accumulation_steps: int, steps: int = 12) -> tuple[int, list[int]]:
    """``steps`` steps: the calls of FSDP2's set_requires_gradient_sync, and each quiet step's hand-out calls."""
    from torch.distributed.fsdp import FSDPModule

    ol = omnilearn.setup(global_batch=32, control_interval=100, total_steps=steps, device="cpu",
                         accumulation_steps=accumulation_steps, handle_signals=False)
    model = ol.wrap_model(sharded(layers))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = iter(ol.data_loader(Rows()))
    sets, fetches = [0], []
    real = FSDPModule.set_requires_gradient_sync

    def counted(self, *args, **kwargs):
        sets[0] += 1
        return real(self, *args, **kwargs)

    count = [0]

    def profile(_frame, event, _arg):
        if event in ("call", "c_call"):
            count[0] += 1

    with pytest.MonkeyPatch.context() as m:
        m.setattr(FSDPModule, "set_requires_gradient_sync", counted)
        for step in range(steps):
            count[0] = 0
            sys.setprofile(profile)
            try:
                batch = next(loader)
            finally:
                sys.setprofile(None)
            if step >= 2:
                fetches.append(count[0])
            for x, y in batch if accumulation_steps > 1 else [batch]:
                ol.backward(nn.functional.cross_entropy(model(x), y))
            opt.step()
            opt.zero_grad()
            ol.step()
    ol.finish()
    return sets[0], fetches


def test_the_gradient_sync_is_set_only_on_a_change_and_the_hand_out_does_not_grow_with_the_model(group):
    small_sets, small = run(2, 1)
    big_sets, big = run(40, 1)
    assert small_sets == big_sets == 0, f"set_requires_gradient_sync called {small_sets}, {big_sets} times"
    assert max(big) <= max(small), f"hand-out calls with 40 sharded layers {big}, with 2 {small}"
    sets, _ = run(2, 2, steps=6)  # wrap_model set it off for the first micro-batch: then on, off, on, ...
    assert sets == 2 * 6 - 1, f"{sets} calls over 6 steps of 2 micro-batches (off, then on for the last, each step)"

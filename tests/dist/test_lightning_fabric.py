"""``OmniLearnFabricStrategy``: a custom Fabric loop, exact over 1 vs 2 heterogeneous ranks, and exact resume.

The data, model and reference are ``test_lightning_exact.py``'s: float64
(``Fabric(precision="64-true")``), SGD with momentum, ``accumulation_steps=2``
(the loop skips the sync with ``fabric.no_backward_sync`` on the first
micro-batch of each step), the split moved by scripted timings at step 3.

- 2 ranks (speeds 3,1) and 1 process equal plain SGD on the global batches
  (relative < 1e-12).
- ``fabric.save`` at step 4 (mid-epoch), then a new Fabric, model and
  optimizer ``fabric.load`` it and loop on: the uninterrupted weights at
  step 14 (< 1e-12), with 2 ranks and with 1 process (elastic).
- A loop whose ``no_backward_sync`` disagrees with the session's
  accumulation raises, naming the fix.

Run: ``python -m pytest -q tests/dist/test_lightning_fabric.py`` (about 30 s).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader


pytest.importorskip("lightning.fabric")
from lightning.fabric import Fabric  # noqa: E402

from omnilearn.integrations.lightning_fabric import OmniLearnFabricStrategy  # noqa: E402
from test_lightning_exact import (EXACT_F64, GLOBAL_BATCH, K, LR, STEPS, _join, data, diff,  # noqa: E402
                                  fresh_port, mlp, reference, spawn)  # noqa: F401  (fresh_port: autouse)

pytestmark = pytest.mark.dist


def loop(world: int, speeds: str | None, save_at: int | None = None, path: str | None = None,
         resume: str | None = None, sync_every: int = K) -> dict:
    """A Fabric training loop to step ``STEPS`` (saving at ``save_at``, or resuming from ``resume``)."""
    strategy = OmniLearnFabricStrategy(global_batch=GLOBAL_BATCH, speeds=speeds, control_interval=3, min_batch=4,
                                       accumulation_steps=K, total_steps=STEPS)
    model, default = mlp(), torch.get_default_dtype()  # the model first: its initial weights drawn as float32's
    torch.set_default_dtype(torch.float64)  # Fabric's "64-true" hands the model's output back in the default dtype
    try:
        return _loop(strategy, model, world, save_at, path, resume, sync_every)
    finally:
        torch.set_default_dtype(default)


def _loop(strategy, model, world: int, save_at: int | None, path: str | None, resume: str | None,
          sync_every: int) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fabric = Fabric(strategy=strategy, accelerator="cpu", devices=world, precision="64-true")
        fabric.launch()
        model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9))
        train = fabric.setup_dataloaders(DataLoader(data(), batch_size=16, shuffle=True))
        if resume is not None:
            fabric.load(resume, {"model": model, "optimizer": opt})
        session = strategy.session
        while session.steps_done < STEPS:
            for i, (x, y) in enumerate(train):
                accumulating = (i + 1) % sync_every != 0
                with fabric.no_backward_sync(model, enabled=accumulating):
                    fabric.backward(F.cross_entropy(model(x), y))
                if not accumulating:
                    opt.step()
                    opt.zero_grad()
                    if session.steps_done == save_at:
                        fabric.save(path, {"model": model, "optimizer": opt})
    session.finish()
    return {"weights": {k: v.detach().clone() for k, v in model.module.state_dict().items()},
            "steps_done": session.steps_done, "plans": [list(session.schedule.peek(s)) for s in range(STEPS)]}


def _two_ranks(rank: int, store: str, out: str) -> None:
    _join(rank, 2, store)
    path = str(Path(out) / "step4.ckpt")
    result = {"run": loop(2, "3,1", save_at=4, path=path), "resumed": loop(2, "3,1", resume=path)}
    torch.save(result, f"{out}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("fabric")
    return out, spawn(_two_ranks, 2, out, "0.0001,0.0003", "rank")  # as speeds 3,1


def test_fabric_loop_two_heterogeneous_ranks_and_one_process_equal_plain_sgd(two_ranks):
    expected = reference(STEPS)
    _, ranks = two_ranks
    plans = [tuple(p) for p in ranks[0]["run"]["plans"]]
    assert plans[0] == (30, 30) and plans[-1][0] > plans[-1][1], plans  # the split moved toward the fast rank
    for r, got in enumerate(ranks):
        assert got["run"]["steps_done"] == STEPS
        assert diff(got["run"]["weights"], expected) < EXACT_F64, f"rank {r}: {diff(got['run']['weights'], expected)}"
    one = loop(1, None)
    assert diff(one["weights"], expected) < EXACT_F64


def test_fabric_resume_continues_data_and_weights(two_ranks):
    out, ranks = two_ranks
    uninterrupted = ranks[0]["run"]["weights"]
    for got in ranks:
        assert got["resumed"]["steps_done"] == STEPS
        assert diff(got["resumed"]["weights"], uninterrupted) < EXACT_F64
    one = loop(1, None, resume=str(out / "step4.ckpt"))  # elastic: 2 ranks to 1
    assert diff(one["weights"], uninterrupted) < EXACT_F64


def test_no_backward_sync_disagreeing_with_the_sessions_accumulation_is_refused():
    with pytest.raises(RuntimeError, match=r"no_backward_sync\(enabled=True\) skips the sync of micro-batch 2 of 2"):
        loop(1, None, sync_every=3)

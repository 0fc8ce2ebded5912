"""Replicas that part are caught, and a syncing backward without a syncing forward is refused before it runs.

Two gloo ranks, one launch, three scenarios (``omnilearn.bsp.replicas``,
``omnilearn.bsp.micro``):

- rank 1 steps its optimizer once more than rank 0 at step 2 (an
  unsynchronised optimizer): every rank raises the same one-line error at
  the next window's meeting (``control_interval=4``: read at step 5), naming
  rank 1 and the likely causes; the same run with both ranks alike goes on;
- accumulation with every micro-batch's forward first, then ``ol.backward``
  on each (DDP would sync nothing: the replicas would part): refused at the
  last ``ol.backward``, before it back-propagates, on every rank;
- the same loop interleaved (forward, backward, forward, backward) trains.

Run: ``python -m pytest -q tests/dist/test_replicas.py tests/unit/test_replica_fingerprint.py``
"""

from __future__ import annotations

import pytest
from ranks import start_ranks
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import omnilearn

pytestmark = pytest.mark.dist


def pairs() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(4, generator=g, dtype=torch.float64), torch.randint(0, 3, (), generator=g))
            for _ in range(96)]


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def _extra_step(rank: int) -> str:
    ol = omnilearn.setup(global_batch=12, control_interval=4, device="cpu", handle_signals=False, speeds="2,1")
    net = ol.wrap_model(model())
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    try:
        for x, y in ol.data_loader(pairs()):
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            opt.step()
            if rank == 1 and ol.steps_done == 2:
                opt.step()  # rank 1 alone
            ol.step()
            if ol.steps_done == 12:
                break
        return f"trained {ol.steps_done}"
    except RuntimeError as e:
        return f"step {ol.steps_done}: {e}"
    finally:
        ol.release()


def _accumulation(forwards_first: bool) -> str:
    ol = omnilearn.setup(global_batch=12, accumulation_steps=2, device="cpu", handle_signals=False, speeds="2,1")
    net = ol.wrap_model(model())
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    try:
        for micro in ol.data_loader(pairs()):
            opt.zero_grad()
            if forwards_first:
                losses = [F.cross_entropy(net(x), y) for x, y in micro]
                for loss in losses:
                    ol.backward(loss)
            else:
                for x, y in micro:
                    ol.backward(F.cross_entropy(net(x), y))
            opt.step()
            ol.step()
            if ol.steps_done == 6:
                break
        ol.finish()
        return f"trained {ol.steps_done}"
    except RuntimeError as e:
        return f"step {ol.steps_done}: {e}"
    finally:
        ol.release()


def _worker(rank: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    said = {"extra_step": _extra_step(rank), "forwards_first": _accumulation(True),
            "interleaved": _accumulation(False)}
    torch.save(said, f"{out}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def said(tmp_path_factory):
    out = tmp_path_factory.mktemp("replicas")
    start_ranks(_worker, (str(out / "store"), str(out)), 2)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]


def test_an_optimizer_stepped_on_one_rank_is_caught_at_the_next_window(said):
    for r in range(2):
        got = said[r]["extra_step"]
        assert got.startswith("step 5: the model on rank(s) [1] differs from rank 0's"), got
        assert "an optimizer stepped on some ranks only" in got and "\n" not in got


def test_forwards_first_accumulation_is_refused_at_the_backward(said):
    for r in range(2):
        got = said[r]["forwards_first"]
        assert got.startswith("step 0: ol.backward(): the last micro-batch's forward ran before the syncing"), got
        assert "forward and then its ol.backward(loss), in turn" in got and "\n" not in got
        assert said[r]["interleaved"] == "trained 6"

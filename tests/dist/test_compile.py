"""``torch.compile`` around and inside ``ol.wrap_model``: exact, and one recompile over a run of moving batches.

3 heterogeneous gloo ranks (emulated speeds 4,2,1), float64, a batch
change at every step from step 2 on (the plan is scripted: 12 changes on
every rank, sizes no rank had before): both orders,
``torch.compile(ol.wrap_model(model))`` and ``ol.wrap_model(torch.compile(model))``,
with a plain ``loss.backward()`` (the output hook weights it) and with
``ol.backward(loss)`` over 2 micro-batches (DDP's
``require_backward_grad_sync`` toggled inside the compiled run), end with
the weights of one eager process training on the global batches (relative
< 1e-12, as the other exactness tests; about 1e-16 measured). The marks
come under compile as in eager: the emulator's wait after every
micro-batch's local backward, one reduced mark per step. Dynamo compiles
the model's forward at most twice (``counters["stats"]["unique_graphs"]``,
2 measured): the first shape, then once with the batch dimension dynamic
(automatic dynamic shapes) for every later size. Backend ``aot_eager``: dynamo and
AOTAutograd (a compiled backward under DDP's hooks), as inductor runs them,
without inductor's C++ compile time (docs/compile.md: inductor checked by hand).

FSDP2: each block compiled in place (``block.compile()``) before
``fully_shard``, then ``ol.wrap_model``: 2 ranks, float64, 10 batch changes
each, equal one eager process; each block compiled at most twice.

Run: ``python -m pytest -q tests/dist/test_compile.py`` (about half a minute on 2 cores).
"""

from __future__ import annotations

import pytest
from ranks import max_relative, scripted_rank_results, start_ranks
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import omnilearn
from omnilearn.decisions import SCRIPTED_ENV
from tokendata import PairData, reference

pytestmark = pytest.mark.dist
STEPS = 14
EXACT_F64 = 1e-12
BACKEND = "aot_eager"
# case: (compile outside ol.wrap_model, ol.backward over this many micro-batches; 0: a plain loss.backward())
CASES = {"compile(wrap) loss.backward": (True, 0), "wrap(compile) loss.backward": (False, 0),
         "compile(wrap) ol.backward x2": (True, 2), "wrap(compile) ol.backward x2": (False, 2)}


class MLP(nn.Module):
    """A user's model: its forward is the user's code (dynamo compiles it as its own frame under DDP's forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden, self.out = nn.Linear(6, 32), nn.Linear(32, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.hidden(x)))


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return MLP().double()


def pair_loss(model, x, y):
    return F.cross_entropy(model(x.double()), y)


def plan(step: int) -> tuple[int, int, int]:
    """The batches from step ``step + 1`` on: every rank's batch moves at every step, none below 4 (2 per micro-batch:
    a size of 1 would be specialised, another compile)."""
    return 30 - step, 14 + 2 * step, 16 - step


def train(outside: bool, micro: int) -> dict:
    """One run of ``STEPS`` steps; this rank's weights, batch sizes, marks and dynamo's graph count."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    ol = omnilearn.setup(global_batch=60, speeds="4,2,1", control_interval=1000, min_batch=2,
                         accumulation_steps=max(micro, 1), device="cpu")
    marks = {"ready": 0, "reduced": 0}
    before_sync, on_reduced = ol.emulator.before_sync, ol.hook.on_reduced

    def ready():
        marks["ready"] += 1
        before_sync()

    def reduced(last: bool) -> None:
        marks["reduced"] += 1
        on_reduced(last)

    ol.emulator.before_sync, ol.hook.on_reduced = ready, reduced
    net = mlp()
    model = torch.compile(ol.wrap_model(net), backend=BACKEND) if outside else \
        ol.wrap_model(torch.compile(net, backend=BACKEND))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader, sizes = ol.data_loader(PairData()), []
    while ol.steps_done < STEPS:
        for batch in loader:
            opt.zero_grad()
            if micro:
                sizes.append(sum(len(x) for x, _ in batch))
                for x, y in batch:
                    ol.backward(pair_loss(model, x, y))
            else:
                x, y = batch
                sizes.append(len(x))
                pair_loss(model, x, y).backward()
            opt.step()
            ol.step()
            if ol.steps_done < STEPS:
                ol.schedule.change(ol.steps_done + 1, plan(ol.steps_done))
            else:
                break
    ol.finish()
    return {"weights": {k: v.detach().clone() for k, v in net.state_dict().items()}, "sizes": sizes, **marks,
            "graphs": counters["stats"]["unique_graphs"]}


def _worker(rank: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=3)
    torch.save({case: train(*how) for case, how in CASES.items()}, f"{out}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("compile")
    return scripted_rank_results(_worker, (str(out / "store"), str(out)), out)


@pytest.mark.parametrize("case", CASES)
def test_compiled_three_ranks_with_moving_batches_equal_one_eager_process(runs, case):
    expected = reference(mlp(), PairData(), pair_loss, 60, STEPS)
    micro = max(CASES[case][1], 1)
    for rank, got in enumerate(r[case] for r in runs):
        changes = sum(a != b for a, b in zip(got["sizes"], got["sizes"][1:]))
        assert changes >= 10, f"rank {rank}: only {changes} batch changes ({got['sizes']})"
        rel = max_relative(got["weights"], expected)
        assert rel < EXACT_F64, f"rank {rank}: {rel:.2e}"
        assert 1 <= got["graphs"] <= 2, f"rank {rank}: {got['graphs']} graphs (the first, then one dynamic batch)"
        assert (got["ready"], got["reduced"]) == (STEPS * micro, STEPS), f"rank {rank}: marks {got}"


class Block(nn.Module):
    """A user's transformer-like block: compiled on its own, then sharded (the usual FSDP2 recipe)."""

    def __init__(self, width_in: int, width_out: int, last: bool = False) -> None:
        super().__init__()
        self.linear, self.last = nn.Linear(width_in, width_out), last

    def forward(self, x):
        y = self.linear(x)
        return y if self.last else torch.tanh(y)


def blocks() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Block(6, 32), Block(32, 32), Block(32, 3, last=True)).double()


def _sharded_worker(rank: int, store: str, out: str) -> None:
    from torch._dynamo.utils import counters
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    ol = omnilearn.setup(global_batch=60, speeds="3,1", control_interval=1000, min_batch=2, device="cpu")
    net = blocks()
    for block in net:
        block.compile(backend=BACKEND)
        fully_shard(block)
    model = ol.wrap_model(fully_shard(net))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader, sizes = ol.data_loader(PairData()), []
    while ol.steps_done < STEPS - 2:
        for x, y in loader:
            sizes.append(len(x))
            opt.zero_grad()
            pair_loss(model, x, y).backward()
            opt.step()
            ol.step()
            if ol.steps_done == STEPS - 2:
                break
            ol.schedule.change(ol.steps_done + 1, (34 - ol.steps_done, 26 + ol.steps_done))
    weights = {k: v.full_tensor().detach() for k, v in net.state_dict().items()}
    ol.finish()
    torch.save({"weights": weights, "sizes": sizes, "graphs": counters["stats"]["unique_graphs"]}, f"{out}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def test_fsdp2_blocks_compiled_before_sharding_with_moving_batches_equal_one_eager_process(tmp_path, monkeypatch):
    monkeypatch.setenv(SCRIPTED_ENV, "0.0005,0.0015")
    start_ranks(_sharded_worker, (str(tmp_path / "store"), str(tmp_path)), 2)
    expected = reference(blocks(), PairData(), pair_loss, 60, STEPS - 2)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        changes = sum(a != b for a, b in zip(got["sizes"], got["sizes"][1:]))
        assert changes >= 10, f"rank {rank}: only {changes} batch changes ({got['sizes']})"
        rel = max_relative(got["weights"], expected)
        assert rel < EXACT_F64, f"rank {rank}: {rel:.2e}"
        assert 1 <= got["graphs"] <= 2 * len(blocks()), f"rank {rank}: {got['graphs']} graphs for 3 blocks"

"""The public Python API (``omnilearn.setup``): one process, an existing process group, and torchrun.

One process: training follows the plan's global batches; misuse errors;
``local_batch``; loops that prefetch, peek, break and ``set_epoch``. Two
gloo ranks in the user's own group: unequal batches follow emulated
speeds (also with small batches, and from an ``IterableDataset`` stream), buffers and weights agree, dropout differs per rank, a shared
setting that differs is named (paths are not compared), each control
interval costs one ``2 x 7`` all-gather and the step rows go to rank 0
only, and ranks out of step (``sync_buffers()`` on one rank) get a clear
error.

Run: ``python -m pytest -q tests/dist/test_api.py`` (about two minutes on 2 cores).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from ranks import start_ranks
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import omnilearn
from omnilearn.config import ConfigError
from omnilearn.data.plan import GlobalPlan
from omnilearn.decisions import SCRIPTED_ENV
from omnilearn.distributed import collect

pytestmark = pytest.mark.dist
ROOT = Path(__file__).resolve().parents[2]


class ListData(torch.utils.data.Dataset):
    """A user's dataset: one sample per __getitem__, the DataLoader's default collate."""

    def __init__(self, n: int = 96, dim: int = 6, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x, self.y = torch.randn(n, dim, generator=g), torch.randint(3, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class Shard(torch.utils.data.IterableDataset):
    """A stream: every other item of ``data``, from ``rank`` on (each rank reads its own shard)."""

    def __init__(self, data: ListData, rank: int) -> None:
        self.data, self.rank = data, rank

    def __iter__(self):
        return (self.data[i] for i in range(self.rank, len(self.data), 2))


def test_single_process_trains_on_the_global_batches_in_plan_order():
    data = ListData()
    ol = omnilearn.setup(global_batch=32, control_interval=4, device="cpu")
    assert ol.world_size == 1
    torch.manual_seed(0)
    model = ol.wrap_model(nn.Linear(6, 3))
    torch.manual_seed(0)
    reference = nn.Linear(6, 3)
    loader = ol.data_loader(data)
    assert ol.batches == (32,) and len(loader) == 3
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    plan = GlobalPlan(len(data), 32, seed=0)
    for epoch in range(2):
        for k, (x, y) in enumerate(loader):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            ol.step(loss)
            idx = plan.step_indices(epoch * 3 + k)
            ref_loss = F.cross_entropy(reference(data.x[idx]), data.y[idx])
            ref_opt.zero_grad()
            ref_loss.backward()
            ref_opt.step()
    summary = ol.finish()
    assert summary["steps"] == 6 and summary["workers"][0]["mean_batch"] == 32
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b)


def test_misuse_gets_a_clear_error():
    ol = omnilearn.setup(global_batch=8, device="cpu")
    assert ol.batches == (8,)  # planned before any dataset
    loader = ol.data_loader(ListData())
    with pytest.raises(RuntimeError, match="one training data source per session"):
        ol.data_loader(ListData())
    with pytest.raises(RuntimeError, match="without a batch"):
        ol.step()
    with pytest.raises(RuntimeError, match="without a batch"):
        ol.backward(torch.zeros((), requires_grad=True))
    batches = iter(loader)
    for _ in range(5):  # a loop may fetch ahead of ol.step() (prefetching), but not without bound
        next(batches)
    with pytest.raises(RuntimeError, match=r"never reported: call ol.step\(\) once per batch"):
        next(batches)
    with pytest.raises(ConfigError, match="workers=3"):
        omnilearn.setup(workers=3, device="cpu")
    with pytest.raises(ConfigError, match="lower global_batch"):
        omnilearn.setup(global_batch=512, device="cpu").data_loader(ListData(96))


def test_local_batch_or_global_batch_not_both():
    assert omnilearn.setup(local_batch=16, device="cpu").global_batch == 16  # x 1 worker
    assert omnilearn.setup(device="cpu").global_batch == 32  # the per-worker default
    with pytest.raises(ConfigError, match="global_batch=64 and local_batch=16 both given; give one"):
        omnilearn.setup(global_batch=64, local_batch=16, device="cpu")
    with pytest.raises(ConfigError, match="local_batch=0 must be a positive integer"):
        omnilearn.setup(local_batch=0, device="cpu")
    assert omnilearn.setup(local_batch=4, device="cpu").cfg.min_batch == 1  # derived: a quarter of the share
    with pytest.raises(ConfigError, match="local_batch=4 x 1 workers: accumulation_steps=8 needs 8 samples per "
                                          "worker, but global_batch=4"):
        omnilearn.setup(local_batch=4, accumulation_steps=8, device="cpu")


def _train_step(ol, model, opt, x, y):
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    ol.step(loss)


def _linear_session(data):
    """One process, global batch 16: a linear model, the session's loader over ``data``, plain SGD."""
    ol = omnilearn.setup(global_batch=16, control_interval=3, device="cpu")
    model = ol.wrap_model(nn.Linear(6, 3))
    return ol, model, ol.data_loader(data), torch.optim.SGD(model.parameters(), lr=0.1)


def test_a_prefetching_loop_fetches_the_next_batch_before_step():
    data = ListData()
    ol, model, loader, opt = _linear_session(data)
    plan, seen = GlobalPlan(len(data), 16, seed=0), []
    for _ in range(2):
        it = iter(loader)
        batch = next(it, None)
        while batch is not None:
            upcoming = next(it, None)  # fetched while the step is still open
            seen.append(batch[0])
            _train_step(ol, model, opt, *batch)
            if upcoming is not None:
                assert ol.ledger.open == len(seen)  # the next step's clock started when this one ended
            batch = upcoming
    assert len(seen) == 12
    for step, x in enumerate(seen):
        assert torch.equal(x, data.x[plan.step_indices(step)])
    assert ol.finish()["steps"] == 12


def test_peek_set_epoch_and_break_are_dataloader_habits():
    data = ListData()
    ol, model, loader, opt = _linear_session(data)
    plan = GlobalPlan(len(data), 16, seed=0)  # 6 steps per epoch
    assert loader.dataset is data and len(loader) == 6
    x0, _ = next(iter(loader))  # a peek: the loop below still starts at step 0
    for k, (x, y) in enumerate(loader):
        assert torch.equal(x, data.x[plan.step_indices(k)])
        _train_step(ol, model, opt, x, y)
        if k == 1:
            break  # the next iteration goes on from step 2
    assert torch.equal(x0, data.x[plan.step_indices(0)])
    assert torch.equal(next(iter(loader))[0], data.x[plan.step_indices(2)])
    loader.sampler.set_epoch(2)  # DistributedSampler's habit: moves on to epoch 2
    steps = 0
    for x, y in loader:
        assert torch.equal(x, data.x[plan.step_indices(12 + steps)])
        _train_step(ol, model, opt, x, y)
        steps += 1
    assert steps == 6 and loader.epoch == 3
    with pytest.raises(RuntimeError, match="already at epoch 3"):
        loader.set_epoch(1)
    assert ol.finish()["steps"] == 8


def test_an_epoch_cut_short_counts_only_the_steps_run():
    ol = omnilearn.setup(global_batch=8, control_interval=3, device="cpu")
    model = ol.wrap_model(nn.Linear(6, 3))
    loader = ol.data_loader(ListData())
    for epoch in range(3):
        loader.set_epoch(epoch)  # without it, each loop would go on where the last one stopped
        for k, (x, y) in enumerate(loader):
            F.cross_entropy(model(x), y).backward()
            ol.step()
            if k == 1:
                break
    assert ol.sampler.state_dict() == {"epoch": 2, "offset": 2}
    assert ol.finish()["steps"] == 6


class BNNet(nn.Module):
    """BatchNorm, and enough compute (a few ms a step) that an emulated 3x slowdown stands out of the noise."""

    def __init__(self, hidden: int = 16, width: int = 0) -> None:
        super().__init__()
        wide = [nn.Linear(hidden, width), nn.ReLU(), nn.Linear(width, hidden)] if width else []
        self.body = nn.Sequential(nn.Linear(6, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), *wide, nn.Linear(hidden, 3))

    def forward(self, x):
        return self.body(x)


class CountingCollectives:
    """Records the size of every all_gather, gather and reduce of this process (what a rank sends and receives)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, bool]] = []
        self.all_gather, self.gather, self.reduce = dist.all_gather, dist.gather, dist.reduce
        self.into_tensor = collect._GATHER_INTO
        dist.all_gather, dist.gather, dist.reduce = self._all_gather, self._gather, self._reduce
        collect._GATHER_INTO = self._all_gather_into_tensor

    def _all_gather(self, parts, tensor, *a, **kw):
        self.calls.append(("all_gather", sum(p.numel() for p in parts), True))
        return self.all_gather(parts, tensor, *a, **kw)

    def _all_gather_into_tensor(self, out, tensor, *a, **kw):
        self.calls.append(("all_gather", out.numel(), True))
        return self.into_tensor(out, tensor, *a, **kw)

    def _gather(self, tensor, parts=None, *a, **kw):
        self.calls.append(("gather", tensor.numel(), parts is not None))
        return self.gather(tensor, parts, *a, **kw)

    def _reduce(self, tensor, *a, **kw):
        self.calls.append(("reduce", tensor.numel(), dist.get_rank() == kw.get("dst", 0)))
        return self.reduce(tensor, *a, **kw)


def _two_rank_worker(rank: int, store: str, out: str) -> None:
    # The user's own set-up: OmniLearn joins the group that already exists (one thread each: 2 ranks share a host).
    torch.set_num_threads(1)
    # The controller sees scripted times (rank 1 three times slower per sample), not the emulated delays as measured
    # on a loaded host: the batch assertions below are then the same on every run.
    os.environ[SCRIPTED_ENV] = "0.001,0.003"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    result = {}
    try:  # a shared setting that differs is named; host paths may differ
        omnilearn.setup(global_batch=48, speeds="3,1" if rank == 0 else "1,3", out=f"{out}/mount{rank}", device="cpu")
    except RuntimeError as e:
        result["settings_error"] = str(e)
    # Each node mounts the speed schedule elsewhere: the same content, so the ranks agree.
    schedule = Path(out) / f"mount{rank}" / "speeds.toml"
    schedule.parent.mkdir(parents=True, exist_ok=True)
    schedule.write_text('[[change]]\nat_step = 0\nspeeds = "3,1"\n')
    ol = omnilearn.setup(local_batch=24, speed_schedule=str(schedule), control_interval=4, min_batch=4, device="cpu",
                         out=f"{out}/mount{rank}/run", min_window_s=0)  # a meeting every interval: counted below
    counting = CountingCollectives()  # from here: training's collectives (the start's settings check is done)
    torch.manual_seed(0)  # as users do: the same initial weights (DDP would broadcast rank 0's anyway)
    model = ol.wrap_model(BNNet(64, 1024))
    result["mask"] = F.dropout(torch.ones(256), 0.5)  # after wrapping: this rank's own stream
    loader = ol.data_loader(ListData(480))
    ol.sync_buffers()  # before any step: the shares still sum to one, nothing is scaled
    assert torch.equal(ol.module.body[1].running_var, torch.ones(64))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(3):
        for x, y in loader:
            _train_step(ol, model, opt, x, y)
    ol.finish()
    result.update(calls=list(counting.calls), global_batch=ol.global_batch, batches=ol.batches,
                  buffers={k: v for k, v in ol.module.state_dict().items() if "running" in k},
                  params={k: v.detach() for k, v in ol.module.named_parameters()})
    # Small per-worker batches (8 each) still rebalance: min_batch is derived (2), not a fixed 8 that froze 8/8.
    small = omnilearn.setup(local_batch=8, speeds="3,1", control_interval=4, device="cpu")
    small_model = small.wrap_model(nn.Linear(6, 3))
    small_opt = torch.optim.SGD(small_model.parameters(), lr=0.05)
    for x, y in small.data_loader(ListData(480)):
        _train_step(small, small_model, small_opt, x, y)
    small.finish()
    result.update(small_batches=small.batches, small_min=small.cfg.min_batch)
    # A stream (IterableDataset), one shard per rank: each step takes this rank's b_i items, in lockstep (the
    # shards of 240 run dry and are reopened).
    stream = omnilearn.setup(global_batch=16, speeds="3,1", control_interval=4, total_steps=96, device="cpu")
    stream_model = stream.wrap_model(nn.Linear(6, 3))
    stream_opt = torch.optim.SGD(stream_model.parameters(), lr=0.05)
    for x, y in stream.data_loader(Shard(ListData(480), rank)):
        _train_step(stream, stream_model, stream_opt, x, y)
    stream.finish()
    result.update(stream_batches=stream.batches, stream_steps=stream.steps_done)
    # Out of step: rank 1 ends a control interval while rank 0 calls sync_buffers(): both are told (rank 1 when
    # it reads that meeting: at its next step() or, here, its own sync_buffers()).
    other = omnilearn.setup(global_batch=48, control_interval=3, device="cpu")
    other.wrap_model(BNNet())
    it = iter(other.data_loader(ListData(480)))
    try:
        for _ in range(3 if rank == 1 else 2):
            next(it)
            other.step()
        other.sync_buffers()
    except RuntimeError as e:
        result["out_of_step"] = str(e)
    torch.save(result, f"{out}/rank{rank}.pt")
    ol.close()


def test_existing_group_batches_buffers_seeds_settings_and_traffic(tmp_path):
    start_ranks(_two_rank_worker, (str(tmp_path / "store"), str(tmp_path)), 2)
    a, b = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    for r in (a, b):
        assert "(rank 1: speeds)" in r["settings_error"]  # out differs too, and is not compared
        assert "ranks [0] at sync_buffers() (or finish()) after 2 steps; ranks [1] at the end of a control " \
               "interval after 3 steps" in r["out_of_step"]
    assert a["global_batch"] == 48  # local_batch 24 x 2 workers
    assert a["batches"] == b["batches"] and sum(a["batches"]) == 48
    assert a["batches"][0] > a["batches"][1]  # the emulated 3x slower worker got the smaller batch
    assert a["small_min"] == 2 and a["small_batches"] == b["small_batches"]
    assert a["stream_steps"] == b["stream_steps"] == 96 and a["stream_batches"] == b["stream_batches"]
    assert a["stream_batches"][0] > a["stream_batches"][1], a["stream_batches"]
    assert a["small_batches"][0] >= 10 > a["small_batches"][1], a["small_batches"]  # moved off 8/8
    assert not torch.equal(a["mask"], b["mask"])  # dropout differs between ranks
    for key in ("buffers", "params"):
        for name in a[key]:
            torch.testing.assert_close(a[key][name], b[key][name], msg=f"{key} {name} differ between ranks")
    # Per control interval of 4 steps: one all_gather of 2 x (12 + 1 + 4 x 8 + 2) numbers: the meeting's row, then
    # room for the window's step rows (8 numbers each, 4 at most) and their count, which rank 0 totals (no
    # reduction of its own), and the replica fingerprint (2 numbers); sync_buffers() and finish()'s flush of the
    # last 2 steps meet alike. Plus one of 2 x 2
    # when the data starts (size and prefetch). 30 steps: 7 intervals, the flush, 2 sync_buffers(); finish()
    # gathers 6 numbers per rank (the per-worker sums) to rank 0 once.
    for calls, main in ((a["calls"], True), (b["calls"], False)):
        gathers = [n for op, n, _ in calls if op == "all_gather"]
        assert sorted(gathers) == [2 * 2] + [2 * (12 + 1 + 4 * 8 + 2)] * 10, gathers
        assert [op for op, _, _ in calls if op == "reduce"] == []
        assert [(n, receives) for op, n, receives in calls if op == "gather"] == [(6, main)]
    for rank in (0, 1):  # each rank's rows in its own file, under rank 0's run directory (its path was shared)
        rows = [json.loads(line) for line in (tmp_path / "mount0" / "run" / "steps" / f"rank-{rank}.jsonl")
                .read_text().splitlines()]
        assert len(rows) == 30 and {r["rank"] for r in rows} == {rank}
    assert not (tmp_path / "mount1" / "run").exists()


def _timeout_worker(rank: int, store: str, out: str) -> None:
    from datetime import timedelta

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=6))
    ol = omnilearn.setup(global_batch=48, control_interval=4, device="cpu")
    model = ol.wrap_model(BNNet())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    message = ""
    try:
        for k, (x, y) in enumerate(ol.data_loader(ListData(480))):
            _train_step(ol, model, opt, x, y)
            if k == 1 and rank == 0:
                ol.sync_buffers()  # misuse: rank 1 does not, and waits in the next step's gradient sync
    except RuntimeError as e:
        message = str(e)
    torch.save({"message": message}, f"{out}/rank{rank}.pt")


def test_sync_buffers_on_one_rank_only_is_a_clear_error(tmp_path):
    start_ranks(_timeout_worker, (str(tmp_path / "store"), str(tmp_path)), 2)
    message = torch.load(tmp_path / "rank0.pt", weights_only=True)["message"]
    assert message.startswith("rank 0 waited at sync_buffers() (or finish()) after 2 steps and the other ranks did "
                              "not come: call step(), sync_buffers() and finish() on every rank")
    assert torch.load(tmp_path / "rank1.pt", weights_only=True)["message"]  # rank 1 fails too, in its step

"""FSDP2's collectives as OmniLearn runs them (bsp/sharded_comms.py): weighted, timed, and cheap when not emulating.

Scripted clocks (the module's ``time`` replaced by counters), no wall-clock assertions:

- the reduce-scatter multiplies the local gradients by this rank's weight (float or 0-dim float64 tensor) and
  SUM-reduce-scatters, honouring the reduction FSDP2 asks for on top (``PREMUL_SUM(f)``: times ``f``; ``AVG``:
  over the group's size, as a later ``set_gradient_divide_factor`` asks) and refusing one that is no scaled sum;
  the emulator's ``before`` runs once per collective;
- a collective or a wait adds its host wall time to ``blocked``, and the process CPU time meanwhile only in a
  step that needs it (``cpu_time()``): none read otherwise (reading it sums every thread's time: costly beside
  gloo's threads, tools/fsdp2_breakdown.py); without ``cpu_time`` it is always read, as before;
- a real ``fully_shard`` model (one gloo rank) through ``sharded.prepare``: every wait timed, the CPU clock read
  only when asked.

Run: ``python -m pytest -q tests/unit/test_sharded_comms.py``
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from omnilearn.bsp import sharded, sharded_comms
from omnilearn.bsp.sharded_comms import HostWait, TimedAllGather, WeightedReduceScatter


class Clocks:
    """The module's ``time``: each wall read is 1 s later, each CPU read 0.25 s later; reads counted."""

    def __init__(self) -> None:
        self.wall_reads = self.cpu_reads = 0

    def perf_counter(self) -> float:
        self.wall_reads += 1
        return float(self.wall_reads)

    def process_time(self) -> float:
        self.cpu_reads += 1
        return self.cpu_reads * 0.25


@pytest.fixture
def clocks(monkeypatch) -> Clocks:
    fake = Clocks()
    monkeypatch.setattr(sharded_comms, "time", fake)
    return fake


class Session:
    """What prepare is given: counts of ``before``, the blocked times, whether this step needs the CPU time."""

    def __init__(self, needs_cpu: bool) -> None:
        self.needs_cpu, self.befores, self.blocks = needs_cpu, 0, []

    def before(self) -> float:
        self.befores += 1
        return 0.0

    def blocked(self, wall_s: float, cpu_s: float) -> None:
        self.blocks.append((wall_s, cpu_s))

    def cpu_time(self) -> bool:
        return self.needs_cpu


@pytest.mark.parametrize("needs_cpu", [False, True])
def test_a_wait_adds_its_wall_time_and_the_cpu_time_only_when_the_step_needs_it(clocks, needs_cpu):
    session = Session(needs_cpu)
    assert HostWait(session.blocked, session.cpu_time).run(lambda a, b=0: a + b, 2, b=3) == 5
    assert session.blocks == [(1.0, 0.25 if needs_cpu else 0.0)]
    assert clocks.cpu_reads == (2 if needs_cpu else 0)


def test_without_cpu_time_the_cpu_clock_is_always_read(clocks):
    session = Session(False)
    HostWait(session.blocked).run(lambda: None)
    assert clocks.cpu_reads == 2 and session.blocks == [(1.0, 0.25)]


def test_a_wait_that_fails_still_adds_its_time(clocks):
    session = Session(False)

    def broken():
        raise RuntimeError("peer gone")
    with pytest.raises(RuntimeError, match="peer gone"):
        HostWait(session.blocked, session.cpu_time).run(broken)
    assert session.blocks == [(1.0, 0.0)]


class Pair:
    """A process group of two (its size is all the reduce-scatter reads)."""

    def size(self) -> int:
        return 2


@pytest.mark.parametrize("weight", [0.25, torch.tensor(0.25, dtype=torch.float64)])
@pytest.mark.parametrize("op, factor", [(None, 1.0), (dist.ReduceOp.SUM, 1.0), (dist.ReduceOp.PREMUL_SUM(1.0), 1.0),
                                        (dist.ReduceOp.PREMUL_SUM(0.5), 0.5), (dist.ReduceOp.AVG, 0.5)])
def test_the_reduce_scatter_weights_the_local_gradients_and_sums_honouring_fsdps_op(clocks, monkeypatch, weight, op,
                                                                                    factor):
    calls = []
    monkeypatch.setattr(sharded_comms, "_REDUCE_SCATTER", lambda out, inp, **kw: calls.append((inp.clone(), kw)))
    session = Session(False)
    comm = WeightedReduceScatter(lambda: weight, session.before, HostWait(session.blocked, session.cpu_time))
    grads = torch.tensor([4.0, 8.0])
    group = Pair()
    comm(torch.empty(1), grads, group=group, op=op)
    (sent, kw), = calls
    assert torch.equal(sent, torch.tensor([1.0, 2.0]) * factor)
    assert kw == {"op": dist.ReduceOp.SUM, "group": group, "async_op": False}
    assert session.befores == 1 and session.blocks == [(1.0, 0.0)] and clocks.cpu_reads == 0


@pytest.mark.parametrize("op", [dist.ReduceOp.MAX, dist.ReduceOp.PRODUCT])
def test_a_reduction_that_is_no_scaled_sum_is_refused_in_one_line(op):
    from omnilearn.config import ConfigError

    session = Session(False)
    comm = WeightedReduceScatter(lambda: 0.25, session.before, None)
    with pytest.raises(ConfigError, match=r"for a RedOpType\.(MAX|PRODUCT) reduction, which is no weighted sum"):
        comm(torch.empty(1), torch.ones(2), group=Pair(), op=op)


def test_on_cuda_a_collective_is_not_host_timed(clocks, monkeypatch):
    monkeypatch.setattr(sharded_comms, "_ALL_GATHER", lambda out, inp, **kw: "work")
    session = Session(True)
    assert TimedAllGather(session.before, None)(torch.empty(2), torch.empty(1), group="g", async_op=True) == "work"
    assert session.befores == 1 and session.blocks == [] and clocks.wall_reads == clocks.cpu_reads == 0


@pytest.fixture
def group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("needs_cpu", [False, True, None])
def test_a_prepared_model_times_every_wait_and_reads_the_cpu_clock_only_when_asked(group, clocks, needs_cpu):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    fully_shard(model[0])
    fully_shard(model)
    session = Session(bool(needs_cpu))
    sharded.prepare(model, weight=lambda: 1.0, before=session.before, blocked=session.blocked,
                    stall=lambda start, end: None, device=torch.device("cpu"),
                    cpu_time=None if needs_cpu is None else session.cpu_time)
    model(torch.randn(5, 3)).sum().backward()
    assert session.blocks, "no wait of the sharded model was timed"
    assert clocks.wall_reads == 2 * len(session.blocks)
    assert clocks.cpu_reads == (0 if needs_cpu is False else 2 * len(session.blocks))

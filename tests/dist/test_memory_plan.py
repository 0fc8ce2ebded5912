"""The memory plan (``memory=[...]``) under FSDP2, with real gloo ranks: counted, capped, exact, re-planned on resume.

Each rank declares its memory (1:4 over 2 ranks; 1:2:4 over 3). In the first step it counts what it holds (its
shards of the parameters, gradients and SGD momentum, the largest unsharded unit, the activations a sample keeps)
and caps its batch to what its memory leaves: rank 0's memory is sized (from a first session's counted bytes) so
that 10 samples fit. The ranks' speeds are equal, so without the plan each would run 30 of the 60; with it rank 0
runs at most its cap from the first interval end on, and the run still equals one process on the same global
batches (float64, relative 1e-12). A DCP checkpoint of the 2-rank run at step 6 resumes on 3 ranks with another
plan (each rank counts again, at its new shard) and ends on the same weights. Each rank says its plan in one line:
even shards (no torch release OmniLearn supports can place FSDP2 state unevenly), and its cap. Under torchrun
(tests/dist/memory_plan_script.py) a worker killed after step 6 costs what it costs FSDP2 without the plan: the
survivor says the restart resumes from the last checkpoint (step 4), and the restart plans again and ends exact.

Run: ``python -m pytest -q tests/dist/test_memory_plan.py``
"""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

import agents
import pytest
import torch
import torch.distributed as dist
from test_fsdp import EXACT_F64, _init, full_weights, mlp, pair_loss, shard, spawn, train, train_resumable
from ranks import max_relative
from tokendata import PairData, reference

import omnilearn
from omnilearn.balance import memplan
from omnilearn.decisions import SCRIPTED_ENV

pytestmark = pytest.mark.dist
SCRIPT = Path(__file__).with_name("memory_plan_script.py")
CAP0 = 10  # the samples rank 0's declared memory is sized for


def _needs(world: int) -> memplan.Needs:
    """Every rank's counted needs in a first session of 1 step (ample memory), the largest of each over ranks."""
    ol = omnilearn.setup(global_batch=60, memory="1GiB", min_batch=6, device="cpu", handle_signals=False)
    model = ol.wrap_model(shard(mlp()))
    train(ol, model, ol.data_loader(PairData()), pair_loss, 1, opt=torch.optim.SGD(model.parameters(), lr=0.1,
                                                                                   momentum=0.9))
    needs = ol.probe_needs
    ol.finish()
    every: list = [None] * world
    dist.all_gather_object(every, (needs.state, needs.block, needs.per_sample))
    return memplan.Needs(*(max(n[i] for n in every) for i in range(3)))


def _worker(rank: int, world: int, store: str, out: str, directory: str, resume: bool) -> None:
    _init(rank, world, store)
    needs = _needs(world)
    small = int((needs.base + (CAP0 + 0.5) * needs.per_sample) / (1 - memplan.MARGIN))
    declared = [small, 4 * small] if world == 2 else [small, 2 * small, 4 * small]
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        ol = omnilearn.setup(global_batch=60, memory=[memplan.human(m) for m in declared] if resume else declared,
                             control_interval=3, min_batch=3, device="cpu", handle_signals=False)
        model, resumed, start = train_resumable(ol, directory, resume)
    torch.save({"weights": full_weights(model), "resumed": resumed, "start": start, "cap": ol.max_batch,
                "plans": [list(ol.schedule.peek(s)) for s in range(start, 12)], "said": said.getvalue(),
                "state": ol.probe_needs.state, "loop": [int(c) for c in ol.loop.caps.reported]}, f"{out}/rank{rank}.pt")
    ol.finish()
    dist.barrier()
    dist.destroy_process_group()


def test_declared_memory_caps_each_rank_exactly_and_a_resume_replans_at_another_worker_count(tmp_path, monkeypatch):
    monkeypatch.setenv(SCRIPTED_ENV, "0.0005,0.0005")  # equal speeds: 30/30 without the plan
    directory = str(tmp_path / "ckpt")
    (tmp_path / "two").mkdir()
    two = spawn(_worker, 2, tmp_path / "two", directory, False)
    expected = reference(mlp(), PairData(), pair_loss, 60, 12, momentum=0.9)
    caps = [r["cap"] for r in two]
    assert caps[0] == CAP0 and caps[1] > 5 * CAP0, caps  # counted: rank 0's memory holds 10 samples
    assert two[0]["plans"][0] == [30, 30]  # before the first interval end: nothing planned yet
    assert all(p[0] <= CAP0 and sum(p) == 60 for p in two[0]["plans"][4:]), two[0]["plans"]
    for r, got in enumerate(two):
        assert max_relative(got["weights"], expected) < EXACT_F64, f"rank {r}"
        lines = [line for line in got["said"].splitlines() if "memory plan" in line]
        assert len(lines) == 1 and f"rank {r}:" in lines[0] and "even FSDP2 shards" in lines[0], got["said"]
        assert f"torch {torch.__version__} has no uneven placement" in lines[0]
        assert f"at most {got['cap']} samples a micro-batch" in lines[0]
    monkeypatch.setenv(SCRIPTED_ENV, "0.0005,0.0005,0.0005")
    (tmp_path / "three").mkdir()
    three = spawn(_worker, 3, tmp_path / "three", directory, True)
    assert three[0]["state"] < two[0]["state"]  # a third of the state now, counted again
    for r, got in enumerate(three):
        assert got["resumed"] and got["start"] == 6
        assert max_relative(got["weights"], expected) < EXACT_F64, f"3 ranks, rank {r}"
    caps = [got["cap"] for got in three]  # counted again at 3 ranks: the planner holds each rank's new cap
    assert caps[0] < caps[1] < caps[2] and three[0]["loop"] == caps, (caps, three[0]["loop"])
    assert all(all(b <= c for b, c in zip(p, caps)) for p in three[0]["plans"][4:]), three[0]["plans"]
    assert three[0]["plans"][-1][0] < 20  # rank 0 below the even share of 20


def test_a_lost_worker_restarts_from_the_last_checkpoint_and_plans_again(tmp_path):
    """tests/dist/memory_plan_script.py under torchrun (--max-restarts 1): rank 1 killed after step 6."""
    tests = str(Path(__file__).parents[1])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(SCRIPT.parent), tests]),
           SCRIPTED_ENV: "0.0005,0.0005"}
    done = agents.torchrun("--standalone", "--nproc-per-node=2", "--max-restarts=1", str(SCRIPT), str(tmp_path),
                           env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    # the ranks write to one stream: a line may hold another rank's message, so messages are counted, not lines
    assert (f"FSDP2's state is sharded across the ranks, so survivors cannot save it: a restart resumes from the last "
            f"checkpoint in {tmp_path / 'ckpt'} (step 4)") in done.stderr, done.stderr[-3000:]
    plans = done.stderr.count("omnilearn: memory plan, rank")
    assert plans == 8, done.stderr[-3000:]  # each rank: the sizing session and the run, in each of the two attempts
    got = torch.load(tmp_path / "attempt-1.pt", weights_only=True)
    assert got["start"] == 4 and got["caps"][0] == got["cap"] == CAP0  # resumed, planned again
    assert max_relative(got["weights"], reference(mlp(), PairData(), pair_loss, 60, 12, momentum=0.9)) < EXACT_F64

"""Out-of-memory recovery and per-worker caps with 2 real gloo workers (one spawn, five short runs).

- Plain: 12 steps of ``B = 64`` on 2 workers (32 each), ``ol.run_step``.
- Emulated cap (``OMNILEARN_FAULT_OOM=1:20``, raised before DDP's forward):
  rank 1 fails on 32 samples at step 0, halves its cap to 16, redoes the
  step as 2 x 16 (rank 0 runs 1 x 32 and waits in the all-reduce), warns;
  the interval end's meeting (step 3, read at step 4) re-plans to (48, 16) from step 5,
  rank 0 records a ``memory_cap`` event; no forward on rank 1 ever exceeds
  16 samples after the error; the weights equal the plain run's.
- The same error raised by the loss, *after* DDP's forward announced a
  syncing backward (the reducer is reset): same weights.
- Accumulation (``K = 2``) with the emulated cap: the same.
- Configured per-worker caps ``max_batch=[48, 16]``: every plan holds them.
- Late errors, after DDP's first bucket rebuild (a second spawn, float64,
  a 10 s group timeout so a desynchronised DDP errors instead of hanging):
  the emulated kind (before DDP's forward) at step 5; the kind raised in the
  loss (after DDP's forward: a reset, pending until the meeting of step 9,
  read at step 10, then every rank resets and the buckets are rebuilt
  together); and a sequence that also fails between that collective reset
  and the rebuild (step 11, in the loss) and in the rebuilding forward itself
  (step 12, before DDP's forward). Each runs 30 steps, ends with the weights of the
  run without errors (1e-12) and with DDP's buckets rebuilt on both ranks.

The controller is ``omnilearn`` with deadband 0.99: only forced cap
re-plans change the split. Run: ``python -m pytest -q tests/dist/test_oom.py`` (~25 s).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from datetime import timedelta

import pytest
from ranks import start_ranks
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import omnilearn
from omnilearn.bsp.memory import FAULT_OOM_ENV, emulate_oom
from tokendata import PairData

pytestmark = pytest.mark.dist
STEPS, B = 12, 64




def run(rank: int, out: str | None = None, oom: str | None = None, loss_cap: int | None = None, **settings) -> dict:
    if oom:
        os.environ[FAULT_OOM_ENV] = oom
    ol = omnilearn.setup(global_batch=B, control_interval=4, deadband=0.99, min_batch=4, device="cpu", out=out,
                         **settings)
    torch.manual_seed(0)
    model = ol.wrap_model(nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)))
    os.environ.pop(FAULT_OOM_ENV, None)
    forwards: list[int] = []

    def loss(batch):
        logits = model(batch[0])
        forwards.append(len(batch[0]))
        if loss_cap is not None and rank == 1 and len(batch[0]) > loss_cap:
            raise torch.OutOfMemoryError("emulated, in the loss after DDP's forward")
        return F.cross_entropy(logits, batch[1])

    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sizes = []
    for batch in ol.data_loader(PairData(STEPS * B)):
        opt.zero_grad()
        ol.run_step(loss, batch)
        sizes.append(list(ol.micro.sizes))
        opt.step()
        ol.step()
    ol.finish()
    return {"weights": [p.detach().clone() for p in model.parameters()], "sizes": sizes, "forwards": forwards,
            "plans": [list(ol.schedule.peek(s)) for s in range(STEPS)], "cap": ol.max_batch}


def early_runs(rank: int, out: str) -> dict:
    return {"plain": run(rank), "oom": run(rank, f"{out}/run", oom="1:20"), "after_forward": run(rank, loss_cap=20),
            "accumulation": run(rank, oom="1:10", accumulation_steps=2), "configured": run(rank, max_batch=[48, 16])}


def _worker(rank: int, store: str, out: str, late: bool) -> None:
    torch.set_num_threads(1)
    # a short timeout: a rank that DDP's collectives leave waiting errors here instead of hanging the test
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=10))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        result = {n: late_run(rank, f) for n, f in LATE_FAULTS.items()} if late else early_runs(rank, out)
    result["stderr"] = err.getvalue()
    torch.save(result, f"{out}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    out = tmp_path_factory.mktemp("memory")
    start_ranks(_worker, (str(out / "store"), str(out), False), 2)
    events = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)], events


def close(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).norm() / y.norm()) for x, y in zip(a, b))


def test_an_out_of_memory_error_lowers_the_cap_replans_and_learns_the_same(two_workers):
    ranks, events = two_workers
    oom = [r["oom"] for r in ranks]
    assert oom[0]["plans"] == [[32, 32]] * 5 + [[48, 16]] * (STEPS - 5)  # re-planned at the first interval end
    assert oom[1]["sizes"] == [[16, 16]] * 5 + [[16]] * (STEPS - 5) and oom[1]["cap"] == 16
    assert max(oom[1]["forwards"]) <= 16 and len(oom[1]["forwards"]) == 5 * 2 + STEPS - 5  # the 32 never ran
    assert oom[0]["sizes"] == [[32]] * 5 + [[48]] * (STEPS - 5)
    for r in range(2):
        assert close(oom[r]["weights"], ranks[r]["plain"]["weights"]) < 1e-5
    assert "rank 1, step 0: out of memory in the forward of a micro-batch of 32 samples; cap none -> 16" in \
        ranks[1]["stderr"]
    assert [(e["rank"], e["cap"]) for e in events if e["event"] == "memory_cap"] == [(1, 16)]
    forced = [e for e in events if e["event"] == "decision" and e["changed"]]
    assert forced[0]["new"] == [48, 16] and "above its cap 16" in forced[0]["reason"]


def test_an_error_after_the_syncing_forward_is_recovered_too(two_workers):
    ranks, _ = two_workers
    assert ranks[1]["after_forward"]["sizes"][0] == [16, 16] and ranks[1]["after_forward"]["forwards"][0] == 32
    for r in range(2):
        assert close(ranks[r]["after_forward"]["weights"], ranks[r]["plain"]["weights"]) < 1e-5


def test_accumulating_workers_split_their_micro_batches_further(two_workers):
    ranks, _ = two_workers
    acc = ranks[1]["accumulation"]
    assert acc["sizes"][0] == [8, 8, 8, 8] and acc["cap"] == 8  # 2 x 16 -> 4 x 8 (<= 10)
    assert all(max(s) <= 8 for s in acc["sizes"]) and acc["plans"][-1][1] <= 16  # planned within 2 x 8
    for r in range(2):
        assert close(ranks[r]["accumulation"]["weights"], ranks[r]["plain"]["weights"]) < 1e-5


def test_configured_per_worker_caps_hold(two_workers):
    ranks, _ = two_workers
    assert all(p == [48, 16] for p in ranks[0]["configured"]["plans"])
    assert ranks[1]["configured"]["cap"] == 16 and ranks[0]["configured"]["cap"] == 48


LATE_STEPS = 30  # control_interval 5: meetings after steps 4, 9, 14..., read a step later; no checks below 6
# Per run: {step: (rank, kind, samples)}: from that step on, a forward of that rank above `samples` runs out of
# memory, before DDP's forward ("pre", the library's emulation) or in the loss after it ("loss").
LATE_FAULTS = {"plain": {}, "pre_forward": {5: (1, "pre", 20)}, "in_loss": {5: (1, "loss", 20)},
               "sequence": {5: (1, "loss", 20), 11: (0, "loss", 40), 12: (1, "pre", 12)}}


def late_run(rank: int, faults: dict[int, tuple[int, str, int]]) -> dict:
    ol = omnilearn.setup(global_batch=B, control_interval=5, deadband=0.99, min_batch=4, device="cpu")
    torch.manual_seed(0)
    model = ol.wrap_model(nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).double())
    loss_cap: list[int] = []

    def loss(batch):
        logits = model(batch[0].double())
        if loss_cap and len(batch[0]) > loss_cap[0]:
            raise torch.OutOfMemoryError("emulated, in the loss after DDP's forward")
        return F.cross_entropy(logits, batch[1])

    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step, batch in enumerate(ol.data_loader(PairData(LATE_STEPS * B))):
        fault_rank, kind, samples = faults.get(step, (None, "", 0))
        if fault_rank == rank and kind == "pre":
            emulate_oom(model, samples)
        elif fault_rank == rank:
            loss_cap[:] = [samples]
        opt.zero_grad()
        ol.run_step(loss, batch)
        opt.step()
        ol.step()
    ol.finish()
    return {"weights": [p.detach().clone() for p in model.parameters()], "cap": ol.max_batch,
            "rebuilt": bool(model._has_rebuilt_buckets)}


@pytest.fixture(scope="module")
def late_errors(tmp_path_factory):
    out = tmp_path_factory.mktemp("late")
    start_ranks(_worker, (str(out / "store"), str(out), True), 2)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]


@pytest.mark.parametrize("name", ["pre_forward", "in_loss", "sequence"])
def test_an_error_after_the_first_bucket_rebuild_keeps_ddp_in_step(late_errors, name):
    for r in range(2):
        got, plain = late_errors[r][name], late_errors[r]["plain"]
        assert close(got["weights"], plain["weights"]) < 1e-12, (name, r)
        assert got["rebuilt"]  # the buckets were rebuilt again after the reset, on both ranks together
    assert "rank 1, step 5: out of memory" in late_errors[1]["stderr"]
    assert late_errors[1][name]["cap"] == (8 if name == "sequence" else 16)


def test_the_sequence_failed_where_it_was_meant_to(late_errors):
    said = late_errors[0]["stderr"] + late_errors[1]["stderr"]
    assert "rank 0, step 11: out of memory in the forward of a micro-batch of 48 samples; cap none -> 24" in said
    assert "rank 1, step 12: out of memory in the forward of a micro-batch of 16 samples; cap 16 -> 8" in said

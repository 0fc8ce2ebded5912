"""The rank processes of the PyTorch doors' launches: every cell of a launch in the same processes, one after another.

:func:`start` starts a launch's ranks (``tests/ranks.py``: the preloaded
fork server) as torchrun would leave them for the frameworks (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``... and the gloo group already made: accelerate
and Lightning find it). Each rank imports its launch's runner
(:mod:`exactness.door_hf`, :mod:`exactness.door_lightning`), whose
``train(cell)`` trains the cell through the door and returns the raw
``exactness.models.Net`` it trained and the dataset indices this rank trained
on at each step. One ``all_gather_object`` per cell brings every rank's
indices (or error): the global batches in rank order, the one-process
reference on them (:func:`exactness.runner.reference`, the row's loss form)
and each rank's batch sizes. Each cell's result is a JSON line per rank in
``out/<launch>-rank<r>.jsonl``: ``{"id", "rank", "s", "rel", "sizes"}`` or
``{"id", "rank", "s", "raised"}``.

See :mod:`exactness.doors` for the table. Run: ``python -m pytest -q tests/exactness/test_doors.py``
"""

from __future__ import annotations

import importlib
import json
import os
import time
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from exactness.doors import DoorCell
from exactness.matrix import STEPS
from exactness.runner import COLLECTIVE_TIMEOUT_S, gather_seen, reference, weights
from ranks import max_relative, start_ranks

RUNNERS = {"hf": "exactness.door_hf", "lightning": "exactness.door_lightning"}


def session_settings(cell: DoorCell) -> dict:
    """``omnilearn.setup()`` keywords every door passes on: the cell's split from step 0, nothing emulated."""
    k = cell.row.accumulation
    return dict(controller="static", emulator="none", speeds=",".join(map(str, cell.split)), min_batch=k,
                timeout_s=COLLECTIVE_TIMEOUT_S, quiet=True, handle_signals=False)


def by_step(micro: list[list[int]], k: int) -> list[list[int]]:
    """Each step's indices from the micro-batches' (``k`` a step), in order."""
    return [[i for m in micro[s * k:(s + 1) * k] for i in m] for s in range(len(micro) // k)]


def run_cell(runner, cell: DoorCell) -> dict:
    """One cell on this rank: ``{"rel", "sizes"}`` or ``{"raised"}``; see the module docstring."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            net, seen = runner.train(cell)
    except Exception as e:
        net, seen = None, f"{type(e).__name__}: {e}"
    gathered = gather_seen(cell.id, seen)
    if isinstance(gathered, dict):
        return gathered
    if any(len(other) != STEPS for other in gathered):
        return {"raised": f"trained {[len(other) for other in gathered]} steps on the ranks, not {STEPS}"}
    steps = tuple(tuple(i for other in gathered for i in other[s]) for s in range(STEPS))
    return {"rel": max_relative(weights(net), reference(cell.row.reference, False, steps)),
            "sizes": [[len(other[s]) for other in gathered] for s in range(STEPS)]}


def worker(rank: int, world: int, store: str, out: str, launch: str, todo: list[DoorCell]) -> None:
    """Every cell of ``todo`` in turn, as the module docstring says."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29400")  # the group is made below
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    runner = importlib.import_module(RUNNERS[launch])
    with open(Path(out) / f"{launch}-rank{rank}.jsonl", "w") as lines:
        for cell in todo:
            start_s = time.perf_counter()
            result = run_cell(runner, cell)
            lines.write(json.dumps({"id": cell.id, "rank": rank, "s": time.perf_counter() - start_s, **result}) + "\n")
            lines.flush()
    dist.barrier()
    dist.destroy_process_group()


def start(launch: str, todo: list[DoorCell], tmp: Path):
    """The launch's ranks, started (``join=False``): the caller joins them (:func:`exactness.runner._join`)."""
    world = todo[0].world
    assert all(c.world == world for c in todo), "one launch, one world size"
    return start_ranks(worker, (world, str(tmp / f"store-{launch}"), str(tmp), launch, todo), world, join=False)

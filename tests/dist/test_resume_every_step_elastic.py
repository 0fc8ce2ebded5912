"""A resume at every step lands on the uninterrupted path at another worker count: the core API, float64.

The loop of tests/resumeloop.py (``omnilearn.setup``, ``wrap_model``, ``data_loader`` with
``set_epoch``, SGD with momentum, a per-step LR schedule, ``ol.save_checkpoint`` / ``ol.load_checkpoint``) of 3
epochs of 6 steps, saving a checkpoint after *every* step (one directory per step), in two runs:

- two gloo ranks (forked from the launcher's fork server: tests/ranks.py ``start_ranks``), and
- one process (this one, no process group).

Every checkpoint k of the two ranks (inside an epoch, at each epoch boundary, one step before and after it, in
the last epoch) is resumed at one process, and every checkpoint k of the one process at two ranks; each ends with
the weights of the uninterrupted run that saved it, to float64 rounding (<= 1e-12 relative; only the per-rank sums
differ). Saving every step does not move the path: the uninterrupted runs agree with each other to the same
bound, and the one-process run that saved every step with one that saved nothing, bitwise.

Run: ``python -m pytest -q tests/dist/test_resume_every_step_elastic.py``
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from ranks import max_relative, start_ranks
from resumeloop import STEPS, train

from omnilearn.distributed import group

pytestmark = pytest.mark.dist

TOLERANCE = 1e-12  # float64, relative: the per-rank partial sums of a step differ from one process's sum


def _two_ranks(rank: int, store: str, out: str) -> None:
    """The uninterrupted run saving every step into ``out/two``, then every checkpoint of ``out/one`` resumed."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    result = {"whole": train(Path(out) / "two", None),
              "resumed": {str(k): train(None, Path(out) / "one" / str(k)) for k in range(1, STEPS)}}
    if rank == 0:
        torch.save(result, Path(out) / "ranks.pt")
    group.barrier()
    group.destroy(wait_s=3.0)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The one-process run (checkpoints in ``one/``), then the two ranks' (checkpoints in ``two/``)."""
    out = tmp_path_factory.mktemp("every-step")
    one = train(out / "one", None)
    start_ranks(_two_ranks, (str(out / "store"), str(out)), 2)
    return {"out": out, "one": one, **torch.load(out / "ranks.pt", weights_only=True)}


def test_saving_every_step_does_not_move_the_path(runs):
    assert all(torch.equal(a, b) for a, b in zip(train(None, None).values(), runs["one"].values()))
    assert max_relative(runs["whole"], runs["one"]) <= TOLERANCE


@pytest.mark.parametrize("k", range(1, STEPS))
def test_a_two_rank_checkpoint_of_step_k_resumed_at_one_process_ends_on_the_path(runs, k):
    resumed = train(None, runs["out"] / "two" / str(k))
    assert resumed.keys() == runs["whole"].keys()
    assert max_relative(resumed, runs["whole"]) <= TOLERANCE, (k, max_relative(resumed, runs["whole"]))


@pytest.mark.parametrize("k", range(1, STEPS))
def test_a_one_process_checkpoint_of_step_k_resumed_at_two_ranks_ends_on_the_path(runs, k):
    resumed = runs["resumed"][str(k)]
    assert resumed.keys() == runs["one"].keys()
    assert max_relative(resumed, runs["one"]) <= TOLERANCE, (k, max_relative(resumed, runs["one"]))

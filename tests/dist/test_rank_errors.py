"""One rank fails, all ranks end: 2 real gloo ranks whose group waits 300 s in a collective, and every rank still ends
at once, the peer naming the failing rank and its error (:mod:`omnilearn.distributed.failures`).

Each case is one launch of 2 ranks from the fork server; each rank trains a few steps of ``B = 8`` and the
failure comes at step 2:

- DDP, an out-of-memory error rank 1 cannot recover from (its loss always runs out of memory: the cap halves
  4 -> 2 -> 1, then one sample does not fit); the rank calls ``ol.finish()`` in a ``finally:``, as a
  script does (before: rank 0 sat in the step's all-reduce and rank 1 in finish's collectives until the
  timeout);
- FSDP2, any out-of-memory error (no redo under a sharded model), the exception left to end rank 1;
- DDP in the user's own loop (no ``run_step``): the out-of-memory error comes from the user's code, and
  ``ol.finish()`` in a ``finally:`` announces it (before: both ranks waited until the timeout);
- rank 0's ``save_checkpoint``: a scheduler whose ``state_dict()`` raises, with ``finish()`` in a
  ``finally:`` (before: rank 1 sat in the save's broadcast until the timeout).

Every rank exits non-zero: the failing rank with its own error, the other with one line
``omnilearn: rank R ends: rank F failed: <Type>: <message>`` -- the announced error, not a timeout and not
gloo's anonymous "Connection closed by peer". No clock is read: with a 300 s group timeout the test ends
promptly or not at all.

Run: ``python -m pytest -q tests/dist/test_rank_errors.py``
"""

from __future__ import annotations

import sys
from datetime import timedelta

import pytest
from ranks import start_ranks
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import omnilearn
from tokendata import PairData

pytestmark = pytest.mark.dist
FAIL_AT = 2  # the step the failure comes at
LONG_S = 300  # the group's collective timeout: a peer that waits for it fails the test by its message


class Exploding:
    """A scheduler whose ``state_dict()`` raises."""

    def state_dict(self) -> dict:
        raise ValueError("this scheduler cannot be saved")


def model_for(case: str) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    if case == "fsdp_oom":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if any(True for _ in layer.parameters()):
                fully_shard(layer)
        fully_shard(model)
    return model


def train(rank: int, case: str, directory: str) -> None:
    ol = omnilearn.setup(global_batch=8, min_batch=1, device="cpu", handle_signals=False)
    model = ol.wrap_model(model_for(case))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def loss(batch):
        if case.endswith("oom") and rank == 1 and ol.steps_done == FAIL_AT:
            raise torch.OutOfMemoryError("emulated: CUDA out of memory. Tried to allocate 2.00 GiB")
        return F.cross_entropy(model(batch[0]), batch[1])

    try:
        for batch in ol.data_loader(PairData(80)):
            opt.zero_grad()
            if case == "loop_oom":  # the user's own loop: the error comes from the user's code
                ol.backward(loss(batch))
            else:
                ol.run_step(loss, batch)
            opt.step()
            ol.step()
            if case == "save" and ol.steps_done == FAIL_AT:
                ol.save_checkpoint(directory, model=model, scheduler=Exploding() if rank == 0 else None)
    finally:
        if case != "fsdp_oom":  # a script's cleanup: after a failure it must not wait for the peers
            ol.finish()


def _worker(rank: int, store: str, case: str, directory: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=LONG_S))
    try:
        train(rank, case, directory)
    except BaseException as e:
        print(f"rank {rank} raised {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        raise


def launch(case: str, tmp_path, capfd) -> tuple[list[int], str]:
    """Both ranks' exit codes and what they said on stderr."""
    ranks = start_ranks(_worker, (str(tmp_path / "store"), case, str(tmp_path / "ckpt")), 2, join=False)
    for process in ranks.processes:
        process.join()
    return [p.exitcode for p in ranks.processes], capfd.readouterr().err


CASES = {
    "ddp_oom": (1, "RuntimeError: rank 1, step 2: out of memory on a micro-batch of 1 samples"),
    "fsdp_oom": (1, "RuntimeError: rank 1, step 2: out of memory with a 4-sample micro-batch; out-of-memory "
                    "recovery is not supported with FSDP2"),
    "loop_oom": (1, "OutOfMemoryError: emulated: CUDA out of memory. Tried to allocate 2.00 GiB"),
}
SAVE_ERROR = "CheckpointError: checkpoint at step 2 was not written: rank 0 raised ValueError: this scheduler cannot be saved"


@pytest.mark.parametrize("case", list(CASES))
def test_an_error_on_one_rank_ends_every_rank_naming_it(case, tmp_path, capfd):
    failing, error = CASES[case]
    codes, said = launch(case, tmp_path, capfd)
    peer = 1 - failing
    assert codes == [1, 1], said
    assert f"rank {failing} raised {error}" in said, said  # its own error, not a consequence of the peer's end
    assert f"omnilearn: rank {peer} ends: rank {failing} failed: {error}" in said, said
    assert f"rank {peer} raised" not in said, said  # it ended on the announcement, not on a collective's error


def test_a_state_dict_that_raises_on_rank_0_is_one_error_every_rank_raises_naming_rank_0(tmp_path, capfd):
    """Rank 0's ``state_dict()`` raising during ``save_checkpoint``: the same catchable CheckpointError on both ranks."""
    codes, said = launch("save", tmp_path, capfd)
    assert codes == [1, 1], said
    assert f"rank 0 raised {SAVE_ERROR}" in said and f"rank 1 raised {SAVE_ERROR}" in said, said
    assert "ends: rank" not in said, said  # no process was ended from outside: both raised it themselves

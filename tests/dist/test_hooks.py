"""The weighting comm hook (``omnilearn.distributed.hooks``) on real gloo process groups.

A 3-rank world split into DDP groups ``{0, 1}`` and ``{2}``: ranks 0 and 1
end with exactly ``w0 g0 + w1 g1`` (their own weights; float64, to 1e-12
relative, where a weight off by 1% shows at 1e-2), rank 2 with ``w2 g2``:
the hook reduces on the group DDP was given, so the third rank's gradient
never leaks in (with the default group it would, and the sums would be
``w0 g0 + w1 g1 + w2 g2`` everywhere). The callbacks run
once per step (``on_ready``) and once per bucket (``on_reduced``, the last
flagged).

Run: ``python -m pytest -q tests/dist/test_hooks.py``
"""

from __future__ import annotations

import pytest
from ranks import start_ranks
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from omnilearn.distributed.hooks import HookState, weighted_allreduce_hook

pytestmark = pytest.mark.dist
WEIGHTS = (5 / 17, 12 / 17, 0.375)


def local_gradient(rank: int) -> torch.Tensor:
    """d/dW of ``sum(x W^T)`` for this rank's input: every entry is the column sum of ``x``."""
    x = inputs(rank)
    return x.sum(0).expand(2, 4).clone()


def inputs(rank: int) -> torch.Tensor:
    return torch.arange(12, dtype=torch.float64).reshape(3, 4) * (rank + 1) / 7


def _worker(rank: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=3)
    pair, solo = dist.new_group([0, 1]), dist.new_group([2])  # every rank creates every group, in order
    torch.manual_seed(0)
    ddp = DDP(nn.Linear(4, 2, bias=False).double(), process_group=pair if rank < 2 else solo, bucket_cap_mb=1e-6)
    calls = {"ready": 0, "reduced": 0, "last": 0}
    state = HookState(process_group=ddp.process_group, weight=WEIGHTS[rank],
                      on_ready=lambda: calls.__setitem__("ready", calls["ready"] + 1),
                      on_reduced=lambda last: calls.update(reduced=calls["reduced"] + 1, last=calls["last"] + last))
    ddp.register_comm_hook(state, weighted_allreduce_hook)
    ddp(inputs(rank)).sum().backward()
    torch.save({"grad": ddp.module.weight.grad.clone(), **calls}, f"{out}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def test_hook_reduces_on_ddps_group_with_exact_weights(tmp_path):
    start_ranks(_worker, (str(tmp_path / "store"), str(tmp_path)), 3)
    got = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(3)]
    g = [local_gradient(r) for r in range(3)]
    pair = g[0] * WEIGHTS[0] + g[1] * WEIGHTS[1]
    for r in (0, 1):
        torch.testing.assert_close(got[r]["grad"], pair, rtol=1e-12, atol=0)
    torch.testing.assert_close(got[2]["grad"], g[2] * WEIGHTS[2], rtol=1e-12, atol=0)
    leaked = pair + g[2] * WEIGHTS[2]
    assert not torch.allclose(got[0]["grad"], leaked)
    for r in range(3):
        assert got[r]["ready"] == 1 and got[r]["last"] == 1 and got[r]["reduced"] >= 1

"""The one weighting of a DDP step (``omnilearn.bsp.backward``, a comm hook) on real gloo process groups.

A 3-rank world split into DDP groups ``{0, 1}`` and ``{2}``: ranks 0 and 1
end with exactly ``w0 g0 + w1 g1`` (their own weights; float64, to 1e-12
relative, where a weight off by 1% shows at 1e-2), rank 2 with ``w2 g2``:
each rank's bucket is multiplied by its weight and summed over the group DDP
was given, never averaged. The weight as a float and as a 0-dim tensor (token
counts); a model whose output is not a pytree (the old output hooks could
not see it: refused until issue 49) is weighted like any other. One comm hook
is registered (OmniLearn's; another is refused in one line), and the marks
come once per step each: ready (the last bucket's hook, before its
all-reduce) and reduced (after DDP's finalisation: every gradient is the
reduced one there), in that order. A session whose speeds change consults
the emulator at the ready mark once on every step.

Run: ``python -m pytest -q tests/dist/test_hooks.py``
"""

from __future__ import annotations

from pathlib import Path

import pytest
from ranks import start_ranks
import torch
import torch.distributed as dist
from torch import nn

from omnilearn.bsp.backward import HookState
from omnilearn.bsp.wrap import wrap

pytestmark = pytest.mark.dist
WEIGHTS = (5 / 17, 12 / 17, 1.0)


def inputs(rank: int) -> torch.Tensor:
    return torch.arange(12, dtype=torch.float64).reshape(3, 4) * (rank + 1) / 7


class Box:
    """A model output that is not a pytree."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class Boxed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 3).double(), nn.Linear(3, 2, bias=False).double())

    def forward(self, x):
        return Box(self.net(x))


def _worker(rank: int, store: str, out: str) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

    from omnilearn.config import ConfigError

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=3)
    pair, solo = dist.new_group([0, 1]), dist.new_group([2])  # every rank creates every group, in order
    dist.barrier()
    marks: list[str] = []
    model = Boxed()
    at_reduced: list[list[torch.Tensor]] = []  # the gradients when the reduced mark comes

    def reduced(last: bool) -> None:
        marks.append("reduced")
        at_reduced.append([p.grad.clone() for p in model.parameters()])

    state = HookState(on_ready=lambda: marks.append("ready"), on_reduced=reduced)
    ddp = wrap(model, torch.device("cpu"), True, state, process_group=pair if rank < 2 else solo)
    grads = []
    for weight in (WEIGHTS[rank], torch.tensor(WEIGHTS[rank], dtype=torch.float64), WEIGHTS[rank]):
        ddp.zero_grad()
        state.weight = weight
        ddp(inputs(rank)).t.sum().backward()
        grads.append([p.grad.clone() for p in ddp.module.parameters()])
        marks.append("step")
    try:
        ddp.register_comm_hook(None, fp16_compress_hook)
        refused = ""
    except ConfigError as e:
        refused = str(e)
    torch.save({"grads": grads, "marks": marks, "hooks": len(ddp._comm_hooks), "at_reduced": at_reduced,
                "refused": refused}, f"{out}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def _expected(ranks: list[int], plain_mean: bool = False) -> list[torch.Tensor]:
    """The weighted sum of the ranks' gradients (``plain_mean``: DDP's unweighted mean, at the first step's
    weights: the model is not stepped between the test's backwards)."""
    grads = []
    for r in ranks:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 3).double(), nn.Linear(3, 2, bias=False).double())
        model(inputs(r)).sum().mul(1 / len(ranks) if plain_mean else WEIGHTS[r]).backward()
        grads.append([p.grad for p in model.parameters()])
    return [sum(g[i] for g in grads) for i in range(len(grads[0]))]


def test_each_rank_weighted_once_and_summed_on_ddps_group(tmp_path):
    start_ranks(_worker, (str(tmp_path / "store"), str(tmp_path)), 3)
    got = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(3)]
    pair, solo = _expected([0, 1]), _expected([2])
    for r in range(3):
        want = pair if r < 2 else solo
        for step in got[r]["grads"]:
            for g, w in zip(step, want):
                torch.testing.assert_close(g, w, rtol=1e-12, atol=0)
        assert got[r]["hooks"] == 1  # OmniLearn's comm hook, the only one
        assert "drop the comm hook" in got[r]["refused"] and "fp16_compress_hook" in got[r]["refused"]
        assert got[r]["marks"] == ["ready", "reduced", "step"] * 3
        for at, step in zip(got[r]["at_reduced"], got[r]["grads"]):
            for g, final in zip(at, step):  # reduced already when the mark came
                torch.testing.assert_close(g, final, rtol=0, atol=0)
    mean = _expected([0, 1], plain_mean=True)  # DDP's unweighted mean differs: the weighting is not a no-op
    assert not torch.allclose(got[0]["grads"][0][0], mean[0])


def _switching_worker(rank: int, store: str, out: str) -> None:
    import omnilearn

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    schedule = Path(out) / "speeds.toml"  # rank 0 fastest, then slowed, then fastest again
    if rank == 0:
        schedule.write_text('[[change]]\nat_step = 0\nspeeds = "2,1"\n[[change]]\nat_step = 3\nspeeds = "1,2"\n'
                            '[[change]]\nat_step = 6\nspeeds = "2,1"\n')
    dist.barrier()
    ol = omnilearn.setup(global_batch=8, speed_schedule=str(schedule), control_interval=100, device="cpu",
                         handle_signals=False, total_steps=9)
    model = ol.wrap_model(nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    slept: list[int] = []  # the emulator consulted at the ready mark, per step
    before_sync = ol.emulator.before_sync
    ol.emulator.before_sync = lambda: (slept.__setitem__(-1, slept[-1] + 1), before_sync())[1]
    seen = []
    for x in ol.data_loader([torch.ones(4) * i for i in range(72)]):
        slept.append(0)
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        seen.append(ol.emulator.slowdown > 1.0)
        ol.step()
    torch.save({"seen": seen, "slept": slept}, f"{out}/rank{rank}.pt")
    ol.release()
    dist.barrier()
    dist.destroy_process_group()


def test_the_emulator_is_consulted_at_the_ready_mark_once_every_step(tmp_path):
    """A session whose speeds change: the ready mark (the last bucket's hook) consults the emulator once a step,
    before the last all-reduce starts, on the slowed steps and the others."""
    start_ranks(_switching_worker, (str(tmp_path / "store"), str(tmp_path)), 2)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert got["seen"] == ([False] * 3 + [True] * 3 + [False] * 3 if rank == 0 else
                               [True] * 3 + [False] * 3 + [True] * 3), got["seen"]
        assert got["slept"] == [1] * 9, f"rank {rank}: the emulator consulted {got['slept']} times"

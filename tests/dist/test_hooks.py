"""The weighted backward on DDP's C++ path (``omnilearn.bsp.backward``) on real gloo process groups.

A 3-rank world split into DDP groups ``{0, 1}`` and ``{2}``: ranks 0 and 1
end with exactly ``w0 g0 + w1 g1`` (their own weights; float64, to 1e-12
relative, where a weight off by 1% shows at 1e-2), rank 2 with ``w2 g2``:
the scale is ``n w_i`` with ``n`` the size of the group DDP was given (with
the world's size the pair would end with 3/2 of its sum). Both routes: a
plain ``loss.backward()`` (the hook on the output scales the gradient that
flows into it) and the loss scaled by the caller (``output_scale=None``).
No comm hook is registered (DDP's own C++ path), and the marks come once per
step each: ready (on the parameter learned to be ready last) and reduced
(after DDP's finalisation: every gradient is the reduced one there), in that
order, also on a second step after learning, with the ready hook after DDP's
(nothing sleeps) and before it (``delayed``: the emulator sleeps there); and
a session whose speeds change moves the hook with them, consulting the
emulator at the ready mark on exactly the steps it slows the rank down.

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
    dist.barrier()
    torch.manual_seed(0)
    marks: list[str] = []
    model = nn.Sequential(nn.Linear(4, 3).double(), nn.Linear(3, 2, bias=False).double())
    at_reduced: list[list[torch.Tensor]] = []  # the gradients when the reduced mark comes

    def reduced(last: bool) -> None:
        marks.append("reduced")
        at_reduced.append([p.grad.clone() for p in model.parameters()])

    state = HookState(on_ready=lambda: marks.append("ready"), on_reduced=reduced)
    ddp = wrap(model, torch.device("cpu"), True, state, process_group=pair if rank < 2 else solo)
    n = ddp.process_group.size()
    grads = []
    for route in ("output hook", "scaled loss", "output hook"):
        ddp.zero_grad()
        state.output_scale = n * WEIGHTS[rank]
        y = ddp(inputs(rank))
        if route == "scaled loss":
            state.output_scale = None
            (y.sum() * (n * WEIGHTS[rank])).backward()
        else:
            y.sum().backward()
        grads.append([p.grad.clone() for p in ddp.module.parameters()])
        marks.append("step")
    equal, early = [], []
    for delayed in (False, True, False):  # equal shares: no output hook, the learned parameter's hook marks it
        ddp.zero_grad()
        state.output_scale, state.delayed = 1.0, delayed
        ddp(inputs(rank)).sum().backward()
        equal.append([p.grad.clone() for p in ddp.module.parameters()])
        early.append(ddp.__dict__["marks"].early)
        marks.append("equal")
    torch.save({"grads": grads, "marks": marks, "hooks": len(ddp._comm_hooks), "equal": equal, "early": early,
                "at_reduced": at_reduced}, f"{out}/rank{rank}.pt")
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


def test_ddp_mean_of_scaled_gradients_is_the_weighted_sum_on_ddps_group(tmp_path):
    start_ranks(_worker, (str(tmp_path / "store"), str(tmp_path)), 3)
    got = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(3)]
    pair, solo = _expected([0, 1]), _expected([2])
    for r in range(3):
        want = pair if r < 2 else solo
        for step in got[r]["grads"]:
            for g, w in zip(step, want):
                torch.testing.assert_close(g, w, rtol=1e-12, atol=0)
        assert got[r]["hooks"] == 0  # DDP's own C++ path: no Python comm hook
        assert got[r]["marks"] == ["ready", "reduced", "step"] * 3 + ["ready", "reduced", "equal"] * 3
        assert got[r]["early"] == [False, True, False]  # the ready hook after DDP's, before it, after it again
        mean = _expected([0, 1], plain_mean=True) if r < 2 else _expected([2], plain_mean=True)
        for step in got[r]["equal"]:
            for g, w in zip(step, mean):
                torch.testing.assert_close(g, w, rtol=1e-12, atol=0)
        for at, step in zip(got[r]["at_reduced"], got[r]["grads"] + got[r]["equal"]):
            for g, final in zip(at, step):  # reduced already when the mark came, on both routes
                torch.testing.assert_close(g, final, rtol=0, atol=0)
    leaked = [g * 2 / 3 for g in pair]  # scaled by the world's size instead of the group's
    assert not torch.allclose(got[0]["grads"][0][0], leaked[0])


class Box:
    """A model output that is not a pytree: the hook on the outputs cannot see the tensor inside."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class Boxed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x):
        return Box(self.lin(x))


def _unhooked_worker(rank: int, store: str, out: str) -> None:
    import omnilearn
    from omnilearn.config import ConfigError

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    ol = omnilearn.setup(global_batch=8, device="cpu", handle_signals=False, speeds="1,1")
    model = ol.wrap_model(Boxed())
    said = ""
    for x in ol.data_loader([torch.ones(4)] * 32):
        model(x).t.sum().backward()
        try:
            ol.step()
        except ConfigError as e:
            said = str(e)
        break
    torch.save({"said": said}, f"{out}/rank{rank}.pt")
    ol.release()
    dist.barrier()
    dist.destroy_process_group()


def test_an_output_the_hook_cannot_see_is_refused_naming_ol_backward(tmp_path):
    start_ranks(_unhooked_worker, (str(tmp_path / "store"), str(tmp_path)), 2)
    for r in range(2):
        said = torch.load(tmp_path / f"rank{r}.pt", weights_only=True)["said"]
        assert "(Box)" in said and "call ol.backward(loss)" in said, said


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
        seen.append((ol.emulator.slowdown > 1.0, model.__dict__["marks"].early))
        ol.step()
    torch.save({"seen": seen, "slept": slept}, f"{out}/rank{rank}.pt")
    ol.release()
    dist.barrier()
    dist.destroy_process_group()


def test_the_ready_hook_goes_before_ddps_while_the_emulator_slows_the_rank_down(tmp_path):
    """A session whose speeds change: on the steps where this rank's emulator sleeps, the ready mark's hook runs
    before DDP's (the emulator is consulted there, once a step); where it does not, after DDP's."""
    start_ranks(_switching_worker, (str(tmp_path / "store"), str(tmp_path)), 2)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        slowed = [s for s, _ in got["seen"]]
        assert slowed == ([False] * 3 + [True] * 3 + [False] * 3 if rank == 0 else
                          [True] * 3 + [False] * 3 + [True] * 3), got["seen"]
        # from step 1 (the first learns the last-ready parameter: its ready mark comes at the graph's end)
        for step, ((slow, early), slept) in list(enumerate(zip(got["seen"], got["slept"])))[1:]:
            assert early == slow, f"rank {rank} step {step}: emulator sleeping {slow}, hook before DDP's {early}"
            assert slept == (1 if slow else 0), f"rank {rank} step {step}: the emulator consulted {slept} times"

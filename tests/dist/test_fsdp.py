"""FSDP2 (``fully_shard``) balanced by OmniLearn, with real gloo ranks: exact, timed, resumable, refused clearly.

- Exactness: a model sharded per layer and at the root, float64, trained by
  2 and by 3 heterogeneous ranks (scripted timings, so the splits are the
  same every run) with ``accumulation_steps=2`` and a split change in the
  middle of a control window, equals one process training on the global
  batches (relative < 1e-12). So does a padded token loss weighted by
  count, and a run whose fastest rank is capped (``max_batch``: the planner
  keeps its share within the cap). FSDP's own average over the world size,
  left in place, is off by far more (checked).
- Timing: rank 1 emulated 12x slower (the delay emulator, measured clocks:
  no script). Both ranks' steps take as long (every collective waits for
  the slow one), yet the compute each measures leaves out the time blocked
  in FSDP's all-gathers and reduce-scatters: rank 1 measures several times
  rank 0's (the step ratio, 1.0, with the waits in), and the controller
  moves batches to rank 0. 12x, not 3x or 6x: the emulator stretches CPU
  time, so on a loaded host a 3x rank measured as little as 1.5x (another
  test beside it) and a 6x rank 1.42x (at 87% of a whole-suite run).
- Checkpoints through DCP: 2 ranks save at step 6 and go on to 12; from
  that checkpoint 2 ranks and 3 ranks (DCP reshards) resume to 12 and end
  with the uninterrupted run's weights (< 1e-12) and its data position.
- Mixed precision (``MixedPrecisionPolicy``: bf16 parameters, fp32 reduce)
  trains on gloo/CPU, close to float32 training.
- Refused in one line naming the route: FSDP1, a model already in DDP,
  DDP keyword arguments for a sharded model, ``max_batch="auto"``, a 2-D
  mesh (HSDP / tensor parallel), parameters fully_shard does not manage.

Run: ``python -m pytest -q tests/dist/test_fsdp.py`` (about a minute on 2 cores).
"""

from __future__ import annotations

import pytest
from ranks import max_relative, start_ranks
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import omnilearn
from omnilearn.config import ConfigError
from omnilearn.decisions import SCRIPTED_ENV
from tokendata import PAD, PairData, TokenData, reference

pytestmark = pytest.mark.dist

EXACT_F64 = 1e-12


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 3)).double()


def token_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(11, 16), nn.Linear(16, 11)).double()


def shard(model: nn.Module, **kwargs) -> nn.Module:
    """The usual way: every layer with parameters, then the root."""
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, **kwargs)
    return fully_shard(model, **kwargs)


def pair_loss(model, x, y):
    return F.cross_entropy(model(x.to(next(model.parameters()).dtype)), y)


def token_loss(model, x, y):
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=PAD)


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}


def train(ol, model, loader, loss_fn, steps: int, counted: bool = False, change_at: int | None = None,
          change: tuple[int, ...] | None = None, capped: bool = False, opt=None, save_at: int | None = None,
          directory: str | None = None) -> None:
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.1)
    while ol.steps_done < steps:
        for batch in loader:
            opt.zero_grad()
            if capped:
                ol.run_step(lambda b: pair_loss(model, *b), batch)
            else:
                for x, y in batch if ol.cfg.accumulation_steps > 1 else [batch]:
                    ol.backward(loss_fn(model, x, y), count=(y != PAD).sum() if counted else None)
            opt.step()
            ol.step()
            if ol.steps_done == change_at:  # a change for the next-but-one step: mid control window
                ol.schedule.change(change_at + 1, change)
            if ol.steps_done == save_at:
                ol.save_checkpoint(directory, model=model, optimizer=opt)
            if ol.steps_done == steps:
                break


def _init(rank: int, world: int, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)


def _exact_worker(rank: int, world: int, store: str, out: str) -> None:
    _init(rank, world, store)
    result = {}
    speeds = "4,2,1"[: 2 * world - 1]
    ol = omnilearn.setup(global_batch=60, speeds=speeds, control_interval=4, min_batch=6, accumulation_steps=2,
                         device="cpu", handle_signals=False)
    model = ol.wrap_model(shard(mlp()))
    change = (20, 40) if world == 2 else (10, 20, 30)
    train(ol, model, ol.data_loader(PairData()), pair_loss, 12, change_at=5, change=change)
    result.update(plans=[list(ol.schedule.peek(s)) for s in range(12)], weights=full_weights(model))
    ol.finish()
    tok = omnilearn.setup(global_batch=60, speeds=speeds, min_batch=6, accumulation_steps=2, device="cpu",
                          handle_signals=False)
    model = tok.wrap_model(shard(token_model()))
    train(tok, model, tok.data_loader(TokenData()), token_loss, 6, counted=True, change_at=2, change=change)
    result["tokens"] = full_weights(model)
    tok.finish()
    if world == 3:  # the fast rank capped at 12 samples: the planner keeps its share within the cap
        cap = omnilearn.setup(global_batch=60, speeds=speeds, control_interval=4, min_batch=6, max_batch=[12, 60, 60],
                              device="cpu", handle_signals=False)
        model = cap.wrap_model(shard(mlp()))
        loader = cap.data_loader(PairData())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        while cap.steps_done < 8:
            for batch in loader:
                opt.zero_grad()
                cap.run_step(lambda b: pair_loss(model, *b), batch)
                opt.step()
                cap.step()
                if cap.steps_done == 8:
                    break
        result.update(capped=full_weights(model), capped_plans=[list(cap.schedule.peek(s)) for s in range(8)])
        cap.finish()
        # FSDP's own reduction (an average over the world size) left in place: not the global batch's gradient
        raw = omnilearn.setup(global_batch=60, speeds=speeds, min_batch=6, device="cpu", handle_signals=False)
        model = raw.wrap_model(shard(mlp()))
        for unit in model.modules():
            if hasattr(unit, "set_custom_reduce_scatter"):
                unit.set_gradient_divide_factor(float(world))
                unit.set_custom_reduce_scatter(_PlainReduceScatter())
        train(raw, model, raw.data_loader(PairData()), pair_loss, 6, change_at=1, change=(10, 20, 30))
        result["unweighted"] = full_weights(model)
        raw.finish()
    torch.save(result, f"{out}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


class _PlainReduceScatter:
    """FSDP2's default reduction, as a custom comm: SUM, then FSDP divides by its factor (the world size)."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op=None, async_op=False):
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def spawn(fn, world: int, tmp, *args) -> list[dict]:
    start_ranks(fn, (world, str(tmp / "store"), str(tmp), *args), world)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=True) for r in range(world)]


@pytest.fixture(scope="module", params=[2, 3])
def exact(request, tmp_path_factory):
    world = request.param
    with pytest.MonkeyPatch.context() as m:
        m.setenv(SCRIPTED_ENV, ",".join(["0.00025", "0.0005", "0.001"][:world]))
        return world, spawn(_exact_worker, world, tmp_path_factory.mktemp(f"fsdp{world}"))


def test_sharded_heterogeneous_ranks_accumulating_equal_one_process(exact):
    world, results = exact
    plans = [tuple(p) for p in results[0]["plans"]]
    assert len(set(plans)) > 1 and all(sum(p) == 60 for p in plans)
    assert plans[6] != plans[5] and len(set(plans[5])) > 1  # unequal splits, changed mid-window
    expected = reference(mlp(), PairData(), pair_loss, 60, 12)
    print(f"{world} ranks vs 1 process: {max(max_relative(got['weights'], expected) for got in results):.1e}")
    for r, got in enumerate(results):
        rel = max_relative(got["weights"], expected)
        assert rel < EXACT_F64, f"rank {r}: {rel:.2e}"


def test_sharded_token_loss_weighted_by_count_equals_one_process(exact):
    expected = reference(token_model(), TokenData(), token_loss, 60, 6)
    for r, got in enumerate(exact[1]):
        rel = max_relative(got["tokens"], expected)
        assert rel < EXACT_F64, f"rank {r}: {rel:.2e}"


def test_a_capped_sharded_rank_stays_within_its_cap_and_the_world_size_average_is_wrong(exact):
    world, results = exact
    if world != 3:
        pytest.skip("run on 3 ranks")
    plans = [tuple(p) for p in results[0]["capped_plans"]]
    assert max(p[0] for p in plans) == 12 and len(set(plans)) > 1, plans  # fastest, yet held at its cap
    expected = reference(mlp(), PairData(), pair_loss, 60, 8)
    assert max_relative(results[2]["capped"], expected) < EXACT_F64
    assert max_relative(results[0]["unweighted"], reference(mlp(), PairData(), pair_loss, 60, 6)) > 1e-3


# ------------------------------------------------------------ timing under an emulated slow rank
def _timing_worker(rank: int, world: int, store: str, out: str) -> None:
    _init(rank, world, store)
    ol = omnilearn.setup(global_batch=96, speeds="12,1", control_interval=6, device="cpu", handle_signals=False)
    torch.manual_seed(0)
    # per-sample compute well above FSDP's per-step overhead (which a slow machine slows as much)
    model = ol.wrap_model(shard(nn.Sequential(nn.Linear(6, 1024), nn.Tanh(), nn.Linear(1024, 1024), nn.Tanh(),
                                              nn.Linear(1024, 3))))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = ol.data_loader(PairData(n=4800))
    measured, collect = [], ol.timer.collect
    ol.timer.collect = lambda: (lambda times: measured.extend(times) or times)(collect())
    while ol.steps_done < 24:
        for x, y in loader:
            opt.zero_grad()
            ol.backward(pair_loss(model, x, y))
            opt.step()
            ol.step()
            if ol.steps_done == 24:
                break
    first = [t for t in measured[1:6]]  # steps 1-5: both at 48 samples (step 0 warms up)
    torch.save({"last": list(ol.schedule.peek(ol.next_step)), "first_batches": list(ol.schedule.peek(1)),
                "compute_s": sum(t.compute_s for t in first) / 5, "wait_s": sum(t.wait_s for t in first) / 5,
                "step_s": sum(t.step_s for t in first) / 5}, f"{out}/rank{rank}.pt")
    ol.finish()
    dist.barrier()
    dist.destroy_process_group()


def test_a_12x_slower_sharded_rank_is_measured_slower_and_its_batch_moves_to_the_fast_rank(tmp_path):
    fast, slow = spawn(_timing_worker, 2, tmp_path)
    assert fast["first_batches"] == [48, 48]
    ratio = slow["compute_s"] / fast["compute_s"]
    print(f"at 48/48: compute {fast['compute_s'] * 1e3:.1f} vs {slow['compute_s'] * 1e3:.1f} ms (ratio {ratio:.2f}), "
          f"step {fast['step_s'] * 1e3:.1f} vs {slow['step_s'] * 1e3:.1f} ms, wait {fast['wait_s'] * 1e3:.1f} vs "
          f"{slow['wait_s'] * 1e3:.1f} ms; batches at the end {fast['last']}")
    # Both steps take as long (every collective waits for the slow rank) ...
    steps = slow["step_s"] / fast["step_s"]
    assert abs(steps - 1) < 0.25
    # ... yet the compute each measures leaves the waits in FSDP's collectives out: with the waits in, the compute
    # ratio would be the step ratio beside it. 12x emulated, several times measured: the emulator makes the slow
    # rank's compute exactly 12x its CPU time, while on a loaded 2-core host the fast rank's wall compute runs well
    # above its CPU time (6x emulated measured 1.42 at 87% of a whole-suite run, 3x measured 1.5-2.3 beside another
    # test and 2.8-3.3 idle)
    assert 1.5 * steps < ratio < 18, (ratio, steps)
    assert fast["wait_s"] > slow["wait_s"]
    b0, b1 = fast["last"]
    assert b0 + b1 == 96 and b0 >= 1.5 * b1, (b0, b1)  # moved from 48/48 to the fast rank (88/8 when idle)


# ------------------------------------------------------------ checkpoints through DCP, resumed at 2 and 3 ranks
def train_resumable(ol, directory: str, resume: bool) -> tuple[nn.Module, bool, int]:
    """The sharded MLP trained to step 12 (SGD with momentum), saved at step 6, or resumed from ``directory``:
    (the model, whether it resumed, the step it started at)."""
    model = ol.wrap_model(shard(mlp()))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = ol.data_loader(PairData())
    resumed = ol.load_checkpoint(directory, model=model, optimizer=opt) if resume else False
    start = ol.next_step
    train(ol, model, loader, pair_loss, 12, opt=opt, save_at=None if resume else 6, directory=directory)
    return model, resumed, start


def _checkpoint_worker(rank: int, world: int, store: str, out: str, directory: str, resume: bool) -> None:
    _init(rank, world, store)
    ol = omnilearn.setup(global_batch=60, speeds="4,2,1"[: 2 * world - 1], control_interval=4, min_batch=6,
                         device="cpu", handle_signals=False)
    model, resumed, start = train_resumable(ol, directory, resume)
    torch.save({"weights": full_weights(model), "resumed": resumed, "start": start, "next_step": ol.next_step,
                "epoch": ol.epoch}, f"{out}/rank{rank}.pt")
    ol.finish()
    dist.barrier()
    dist.destroy_process_group()


def test_a_sharded_checkpoint_resumes_at_the_same_and_at_another_world_size(tmp_path, monkeypatch):
    directory = tmp_path / "ckpt"
    monkeypatch.setenv(SCRIPTED_ENV, "0.00025,0.0005")
    (tmp_path / "whole").mkdir()
    whole = spawn(_checkpoint_worker, 2, tmp_path / "whole", str(directory), False)
    assert sorted(p.name for p in directory.iterdir() if p.name.startswith("step-")) == [
        "step-000000006.dcp", "step-000000006.json", "step-000000006.pt"]  # shards, manifest, session
    expected = reference(mlp(), PairData(), pair_loss, 60, 12, momentum=0.9)
    assert max_relative(whole[0]["weights"], expected) < EXACT_F64
    for world, speeds in ((2, "0.00025,0.0005"), (3, "0.00025,0.0005,0.001")):
        monkeypatch.setenv(SCRIPTED_ENV, speeds)
        (tmp_path / f"r{world}").mkdir()
        again = spawn(_checkpoint_worker, world, tmp_path / f"r{world}", str(directory), True)
        for r, got in enumerate(again):
            assert got["resumed"] and got["start"] == 6 and got["next_step"] == 12
            assert max_relative(got["weights"], expected) < EXACT_F64, f"{world} ranks, rank {r}"
            assert max_relative(got["weights"], whole[0]["weights"]) < EXACT_F64


# ------------------------------------------------------------ mixed precision, and what is refused
def _precision_and_refusals_worker(rank: int, world: int, store: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecisionPolicy
    from torch.nn.parallel import DistributedDataParallel as DDP

    _init(rank, world, store)
    result = {}
    ol = omnilearn.setup(global_batch=60, speeds="2,1", control_interval=4, min_batch=6, device="cpu",
                         handle_signals=False)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    torch.manual_seed(0)
    model = ol.wrap_model(shard(nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 3)), mp_policy=policy))
    train(ol, model, ol.data_loader(PairData()), pair_loss, 12)
    result["mixed"] = full_weights(model)
    result["dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
    ol.finish()

    def refused(make, **settings) -> str:
        s = omnilearn.setup(global_batch=60, device="cpu", handle_signals=False, **settings)
        try:
            s.wrap_model(make())
        except (TypeError, ConfigError) as e:
            return str(e)
        finally:
            s.finish()
        return "accepted"

    torch.manual_seed(0)
    def fsdp1():  # FSDP1 needs an accelerator to be built: an instance of its class, not initialised, will do
        model = FullyShardedDataParallel.__new__(FullyShardedDataParallel)
        nn.Module.__init__(model)
        return model
    result["fsdp1"] = refused(fsdp1)
    result["ddp"] = refused(lambda: DDP(nn.Linear(6, 3)))
    result["auto"] = refused(lambda: shard(mlp()), max_batch="auto")
    s = omnilearn.setup(global_batch=60, device="cpu", handle_signals=False)
    try:
        s.wrap_model(shard(mlp()), find_unused_parameters=True)
    except TypeError as e:
        result["kwargs"] = str(e)
    s.finish()
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
    result["hsdp"] = refused(lambda: shard(mlp(), mesh=mesh))

    def partly():
        from torch.distributed.fsdp import fully_shard
        m = mlp()
        fully_shard(m[0])  # the root is not sharded: the last layer's gradients would never be reduced
        fully_shard(m[2])
        return m
    result["partly"] = refused(partly)
    torch.save(result, f"{out}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def test_mixed_precision_trains_and_what_cannot_be_balanced_is_refused_in_one_line(tmp_path):
    results = spawn(_precision_and_refusals_worker, 2, tmp_path)
    got = results[0]
    assert got["dtypes"] == ["torch.float32"]  # sharded parameters stay float32; bf16 only for compute
    torch.manual_seed(0)
    expected = reference(nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 3)), PairData(), pair_loss, 60, 12)
    print(f"bf16 parameters, fp32 reduce vs float32: {max_relative(got['mixed'], expected):.1e}")
    assert 1e-7 < max_relative(got["mixed"], expected) < 3e-2  # bf16 compute: close, not equal
    for key, words in {"fsdp1": ["FSDP1 model (FullyShardedDataParallel)", "fully_shard"],
                       "ddp": ["already wrapped in DistributedDataParallel", "pass the plain module"],
                       "auto": ['max_batch="auto" is not supported with FSDP2', "max_batch=<samples>"],
                       "kwargs": ["DDP keyword arguments ['find_unused_parameters']", "fully_shard"],
                       "hsdp": ["device mesh of shape (1, 2)", "one dimension"],
                       "partly": ["not sharded by fully_shard at its root", "root module last"]}.items():
        message = got[key]
        assert all(w in message for w in words) and "\n" not in message, (key, message)

"""``OmniLearnStrategy`` under Lightning: exact weights (1 vs 2 vs 3 heterogeneous ranks) and exact resume.

float64 throughout (``Trainer(precision="64-true")``), SGD with momentum,
``accumulate_grad_batches=2`` (unequal micro-batches), the controller fed
scripted timings so the split changes at the first control interval end
(every 3 steps). 360 samples, global batch 60: 6 steps per epoch, 14 steps.

- 2 ranks (speeds 3,1) and 3 ranks (speeds 4,2,1) equal one process of
  plain SGD on the same global batches (relative < 1e-12), and one process
  under the strategy; OmniLearn's step count is Lightning's ``global_step``.
- Resume: the 2-rank run saved checkpoints every 4 steps (steps 4 and 8 are
  mid-epoch, 12 ends epoch 1) and at each epoch end. ``fit(ckpt_path=...)``
  from step 4 with 2 ranks, 3 ranks and 1 process, and from the end of
  epoch 1 with 2 ranks, ends with the weights of the uninterrupted run
  (< 1e-12), at step 14, with the data continuing where it stopped.
- DDP keyword arguments given to the strategy reach the wrapped model.
- A second ``fit()`` on the same Trainer (``max_steps`` raised to 18)
  continues the run: the data and step count go on (steps 14..17 of the
  plan); the optimizer is new (Lightning calls ``configure_optimizers()``
  again in every fit).
- Validation is sharded (each rank a disjoint part, 25+25 and 17+17+16 of
  50) and ``val_loss`` logged with ``sync_dist=True`` is the mean over all 50.

Run: ``python -m pytest -q tests/dist/test_lightning_exact.py`` (about a minute on 2 cores).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
from ranks import start_ranks
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from omnilearn.data.schedule import GlobalPlan
from omnilearn.decisions import SCRIPTED_ENV

pl = pytest.importorskip("lightning.pytorch")
from omnilearn.integrations.lightning import OmniLearnStrategy  # noqa: E402

pytestmark = pytest.mark.dist

SAMPLES, VAL_SAMPLES, GLOBAL_BATCH, STEPS, K, LR = 360, 50, 60, 14, 2, 0.1
EXACT_F64 = 1e-12


def data(samples: int = SAMPLES, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 6, generator=g, dtype=torch.float64)
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long())


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).double()


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()
        self.val_seen = 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_seen += len(y)
        self.log("val_loss", F.cross_entropy(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)


@pytest.fixture(autouse=True)
def fresh_port(monkeypatch):
    """Lightning keeps the port it chose for a one-process group in MASTER_PORT; each test's group gets its own."""
    monkeypatch.delenv("MASTER_PORT", raising=False)


def weights(module: pl.LightningModule) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.net.state_dict().items()}


def reference(steps: int, new_optimizer_at: int | None = None) -> dict[str, torch.Tensor]:
    """One process, no Lightning, no OmniLearn: SGD on the plan's global batches (a fresh optimizer at a step)."""
    model, d = mlp(), data()
    x, y = d.tensors
    plan = GlobalPlan(SAMPLES, GLOBAL_BATCH, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for step in range(steps):
        if step == new_optimizer_at:
            opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        idx = torch.as_tensor(plan.step_indices(step))
        opt.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def trainer(world: int, steps: int, speeds: str | None, callbacks=(), **options) -> pl.Trainer:
    strategy = OmniLearnStrategy(global_batch=GLOBAL_BATCH, speeds=speeds, control_interval=3, min_batch=4,
                                 **options)
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=world, max_steps=steps, precision="64-true",
                      accumulate_grad_batches=K, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=bool(callbacks), callbacks=list(callbacks),
                      num_sanity_val_steps=0)


def loaders() -> tuple[DataLoader, DataLoader]:
    return DataLoader(data(), batch_size=16, shuffle=True), DataLoader(data(VAL_SAMPLES, seed=1), batch_size=8)


class SeeDDP(pl.Callback):
    """What the wrapped model got from the strategy's DDP keyword arguments."""

    def on_train_start(self, trainer, pl_module):
        model = trainer.strategy.model
        self.seen = {"gradient_as_bucket_view": model.gradient_as_bucket_view,
                     "bucket_bytes_cap": model.bucket_bytes_cap}


def fit(world: int, steps: int, speeds: str | None, ckpt: str | None = None, callbacks=(), **options) -> dict:
    """A fresh model and Trainer trained to ``steps`` (from ``ckpt``): what the tests compare."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, t = Net(), trainer(world, steps, speeds, callbacks, **options)
        t.fit(model, *loaders(), ckpt_path=ckpt)
    session = t.strategy.session
    return {"weights": weights(model), "global_step": t.global_step, "steps_done": session.steps_done,
            "plans": [list(session.schedule.peek(s)) for s in range(steps)], "val_seen": model.val_seen,
            "trainer": t, "model": model}


def checkpoints(ck: Path) -> list:
    every4 = pl.callbacks.ModelCheckpoint(dirpath=ck / "steps", every_n_train_steps=4, save_top_k=-1,
                                          filename="{step}")
    epochs = pl.callbacks.ModelCheckpoint(dirpath=ck / "epochs", every_n_epochs=1, save_top_k=-1,
                                          save_on_train_epoch_end=True, filename="{epoch}-{step}")
    return [every4, epochs]


def _join(rank: int, world: int, store: str) -> None:
    """Join a gloo group the way torchrun would leave it for Lightning (it finds the group already made)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29400")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)


def _keep(run: dict) -> dict:
    return {k: v for k, v in run.items() if k not in ("trainer", "model")}


def _two_ranks(rank: int, store: str, out: str) -> None:
    _join(rank, 2, store)
    ck = Path(out) / "ck"
    ddp = SeeDDP()
    first = fit(2, STEPS, "3,1", callbacks=[*checkpoints(ck), ddp], gradient_as_bucket_view=True, bucket_cap_mb=1)
    result = {"run": _keep(first), "ddp": ddp.seen}
    t, model = first["trainer"], first["model"]
    validated = t.validate(model, loaders()[1], verbose=False)[0]["val_loss"]
    result["validate"] = {"val_loss": float(validated), "val_seen": model.val_seen - first["val_seen"]}
    t.fit_loop.epoch_loop.max_steps = STEPS + 4  # a second fit on the same Trainer continues the run
    t.fit(model, loaders()[0])
    result["second"] = {"weights": weights(model), "global_step": t.global_step,
                        "steps_done": t.strategy.session.steps_done}
    dist.barrier()
    result["from4"] = _keep(fit(2, STEPS, "3,1", ckpt=str(ck / "steps" / "step=4.ckpt")))
    result["from_epoch"] = _keep(fit(2, STEPS, "3,1", ckpt=str(ck / "epochs" / "epoch=1-step=12.ckpt")))
    torch.save(result, f"{out}/two{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def _three_ranks(rank: int, store: str, out: str) -> None:
    _join(rank, 3, store)
    result = {"run": _keep(fit(3, STEPS, "4,2,1")),
              "from4": _keep(fit(3, STEPS, "4,2,1", ckpt=str(Path(out) / "ck" / "steps" / "step=4.ckpt")))}
    torch.save(result, f"{out}/three{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def spawn(worker, world: int, out: Path, scripted: str, prefix: str) -> list[dict]:
    """``worker(rank, store, out)`` on ``world`` gloo ranks fed ``scripted`` timings; each rank's result file."""
    with pytest.MonkeyPatch.context() as m:
        m.setenv(SCRIPTED_ENV, scripted)  # the spawned workers inherit it
        start_ranks(worker, (str(out / f"store{world}"), str(out)), world)
    return [torch.load(out / f"{prefix}{r}.pt", weights_only=True) for r in range(world)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("lightning_exact")
    two = spawn(_two_ranks, 2, out, "0.0001,0.0003", "two")  # as speeds 3,1
    three = spawn(_three_ranks, 3, out, "0.00025,0.0005,0.001", "three")  # as speeds 4,2,1
    return {"two": two, "three": three, "ck": out / "ck"}


def diff(a: dict, b: dict) -> float:
    """The largest relative difference over the tensors (norm of the difference over the norm)."""
    return max(float((a[k] - b[k]).norm() / b[k].norm()) for k in b)


def max_abs(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in b)


def test_two_and_three_heterogeneous_ranks_accumulating_equal_one_process(runs):
    expected = reference(STEPS)
    one = fit(1, STEPS, None)
    assert diff(one["weights"], expected) < EXACT_F64, diff(one["weights"], expected)
    for name in ("two", "three"):
        plans = [tuple(p) for p in runs[name][0]["run"]["plans"]]
        assert plans[0] != plans[-1] and all(sum(p) == GLOBAL_BATCH for p in plans), plans  # the split moved
        assert plans[-1][0] > plans[-1][-1], plans[-1]  # toward the fast rank
        for r, got in enumerate(runs[name]):
            run = got["run"]
            assert run["global_step"] == run["steps_done"] == STEPS  # one step counter
            assert diff(run["weights"], expected) < EXACT_F64, f"{name} rank {r}: {diff(run['weights'], expected):.2e}"
            assert max_abs(run["weights"], one["weights"]) < EXACT_F64


def test_resume_mid_epoch_and_from_epoch_end_continues_data_and_weights(runs):
    uninterrupted = runs["two"][0]["run"]["weights"]
    for name, key in (("two", "from4"), ("two", "from_epoch"), ("three", "from4")):
        for r, got in enumerate(runs[name]):
            resumed = got[key]
            assert resumed["global_step"] == resumed["steps_done"] == STEPS, (name, key, r)
            assert diff(resumed["weights"], uninterrupted) < EXACT_F64, f"{name} {key} rank {r}"
    one = fit(1, STEPS, None, ckpt=str(runs["ck"] / "steps" / "step=4.ckpt"))  # elastic: 2 ranks to 1
    assert one["global_step"] == one["steps_done"] == STEPS
    assert diff(one["weights"], uninterrupted) < EXACT_F64


def test_ddp_keyword_arguments_reach_the_wrapped_model(runs):
    for got in runs["two"]:
        assert got["ddp"] == {"gradient_as_bucket_view": True, "bucket_bytes_cap": 1024 * 1024}


def test_second_fit_on_the_same_trainer_continues_the_run(runs):
    expected = reference(STEPS + 4, new_optimizer_at=STEPS)  # Lightning calls configure_optimizers() again
    for got in runs["two"]:
        second = got["second"]
        assert second["global_step"] == second["steps_done"] == STEPS + 4
        assert diff(second["weights"], expected) < EXACT_F64


def test_validation_is_sharded_and_its_mean_is_over_every_sample(runs):
    model = mlp()
    model.load_state_dict(runs["two"][0]["run"]["weights"])
    x, y = data(VAL_SAMPLES, seed=1).tensors
    with torch.no_grad():
        expected = float(F.cross_entropy(model(x), y))
    seen = [got["validate"]["val_seen"] for got in runs["two"]]
    assert seen == [25, 25]
    for got in runs["two"]:
        assert got["validate"]["val_loss"] == pytest.approx(expected, rel=1e-12)
    # during fit: two epoch-end validations, disjoint parts (3 ranks: 17 + 17 + 16 of 50)
    assert [got["run"]["val_seen"] for got in runs["three"]] == [34, 34, 32]

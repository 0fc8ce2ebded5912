"""``OmniLearnTrainer`` (Hugging Face ``Trainer``) resumed at every step lands on the uninterrupted path, float64.

A tiny float64 regressor called as a Hugging Face model (``model(x=..., labels=...)`` returns ``{"loss",
"logits"}``), Trainer's defaults for what carries state across a resume (AdamW, the linear LR decay: the rate
changes every step), 3 epochs of 5 steps (a global batch of 8 of 42 samples, a seeded shuffle per epoch: 2 samples
left out, other ones each epoch, so the epoch's sampler seed matters). The uninterrupted runs save a Trainer
checkpoint at every step (``save_strategy="steps", save_steps=1, save_total_limit=None``), one in this process
(1 worker: the door runs in-process at world size 1) and one in 2 gloo rank processes (torchrun's environment,
forked from the preloaded fork server of tests/ranks.py; scripted speeds 4,1: the split moves from 4/4 to 6/2).
For every step k from 1 to 14 (mid-epoch, each epoch boundary 5 and 10, one step before and after them, the last
epoch) a fresh trainer resumes ``checkpoint-k`` with ``train(resume_from_checkpoint=<path>)`` and trains to 15:

- at the same worker count its final weights are the uninterrupted run's, bitwise (1 -> 1 and 2 -> 2);
- at another worker count (1 -> 2 and 2 -> 1, every k too) they equal them to <= 1e-12 relative;
- saving at every step leaves the path alone (bitwise the run that never saves), and 2 workers equal 1 (<= 1e-12).

Each resumed session must say it resumed at step k. Measured: 2 -> 1 and 1 -> 2 within 2.5e-16 relative. Both
processes ``gc.freeze()`` what they hold once imported: Trainer's ``gc.collect()`` at every ``train()`` walked it
(about 1 s a resume).

Run: ``python -m pytest -q tests/dist/test_hf_resume_every_step.py``
"""

from __future__ import annotations

import gc
import os

import pytest
import torch
import torch.nn.functional as F
from needs import needs
from ranks import free_port, max_relative, scripted_rank_results

# transformers and accelerate are imported where they are used: every pytest-xdist worker collects this file
pytestmark = [pytest.mark.dist, needs("transformers", "hf"), needs("accelerate", "hf")]

EPOCHS, STEPS_PER_EPOCH, GLOBAL_BATCH, SAMPLES = 3, 5, 8, 42
STEPS = EPOCHS * STEPS_PER_EPOCH
RESUMED = range(1, STEPS)  # every step but the last
EXACT_F64 = 1e-12
SPEEDS_4_1 = "0.00025,0.001"  # scripted per-sample times of 2 ranks: the controller moves the split


class Rows(torch.utils.data.Dataset):
    """``SAMPLES`` float64 regression rows as Hugging Face items: ``{"x", "labels"}``."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(SAMPLES, 5, generator=g, dtype=torch.float64)
        self.y = torch.randn(SAMPLES, 1, generator=g, dtype=torch.float64)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "labels": self.y[i]}


class Regressor(torch.nn.Module):
    """A 2-layer float64 net with Hugging Face's calling convention: the loss is the batch's mean squared error."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()

    def forward(self, x, labels=None):
        y = self.net(x)
        return {"logits": y} if labels is None else {"loss": F.mse_loss(y, labels), "logits": y}


def train(out: str, save: bool = False, resume: str | None = None) -> tuple[dict[str, torch.Tensor], list]:
    """One run to the end (saving at every step with ``save``, resuming the checkpoint folder ``resume``): the final
    weights and the session's split of every step."""
    from transformers import TrainingArguments

    from omnilearn.integrations.hf import OmniLearnTrainer

    args = TrainingArguments(output_dir=out, per_device_train_batch_size=4, num_train_epochs=EPOCHS,
                             learning_rate=0.05, weight_decay=0.01, dataloader_drop_last=True,
                             save_strategy="steps" if save else "no", save_steps=1, save_total_limit=None,
                             logging_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=0)
    trainer = OmniLearnTrainer(model=Regressor(), args=args, train_dataset=Rows(),
                               omnilearn=dict(global_batch=GLOBAL_BATCH, control_interval=3, min_batch=1))
    trainer.train(resume_from_checkpoint=resume)
    session = trainer.session
    assert trainer.state.global_step == STEPS and session.steps_done == STEPS
    if resume is not None:  # the resume happened where it was asked to
        assert session.resumed_from is not None and session.resumed_from[0] == int(resume.rsplit("-", 1)[1])
    plans = [list(session.schedule.peek(s)) for s in range(STEPS)]
    return {k: v.detach().clone() for k, v in session.module.state_dict().items()}, plans


def _ranks(rank: int, world: int, port: int, out: str) -> None:
    """A rank of the 2-worker runs: the uninterrupted one, then every resume of its own and of the 1-worker run's
    checkpoints (``out/one``, written before)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    whole, plans = train(f"{out}/two", save=True)
    gc.freeze()  # the imports' objects: Trainer's gc.collect() at each train() walked them (1 s a run)
    same = [train(f"{out}/scratch", resume=f"{out}/two/checkpoint-{k}")[0] for k in RESUMED]
    grown = [train(f"{out}/scratch", resume=f"{out}/one/checkpoint-{k}")[0] for k in RESUMED]
    torch.save(dict(whole=whole, plans=plans, same=same, grown=grown), f"{out}/rank{rank}.pt")
    from omnilearn.distributed import group
    group.destroy()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The uninterrupted runs: 1 worker here (saving, and never saving), then the 2 ranks (their run and resumes)."""
    out = tmp_path_factory.mktemp("hf_every_step")
    one, _ = train(str(out / "one"), save=True)
    gc.freeze()  # the objects alive now: Trainer's gc.collect() at each train() walked them (0.8 s a run here)
    try:
        plain, _ = train(str(out / "plain"))
        yield out, one, plain, scripted_rank_results(_ranks, (2, free_port(), str(out)), out, nprocs=2,
                                                     times=SPEEDS_4_1)
    finally:
        gc.unfreeze()


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b)


def test_saving_every_step_keeps_the_path_and_two_workers_equal_one(runs):
    _, one, plain, two = runs
    assert next(iter(one.values())).dtype == torch.float64
    assert same_weights(one, plain), "saving a checkpoint at every step changed the trajectory"
    assert same_weights(two[0]["whole"], two[1]["whole"])
    plans = [tuple(p) for p in two[0]["plans"]]
    assert len(set(plans)) > 1 and all(sum(p) == GLOBAL_BATCH for p in plans), f"the split never moved: {plans}"
    assert max_relative(two[0]["whole"], one) <= EXACT_F64, max_relative(two[0]["whole"], one)


@pytest.mark.parametrize("k", RESUMED)
def test_one_worker_resuming_step_k_ends_on_the_uninterrupted_weights(runs, tmp_path, k):
    out, one, _, two = runs
    same, _ = train(str(tmp_path / "same"), resume=str(out / "one" / f"checkpoint-{k}"))
    assert same_weights(same, one), (k, max_relative(same, one))
    shrunk, _ = train(str(tmp_path / "shrunk"), resume=str(out / "two" / f"checkpoint-{k}"))  # 2 workers -> 1
    assert max_relative(shrunk, two[0]["whole"]) <= EXACT_F64, (k, max_relative(shrunk, two[0]["whole"]))


@pytest.mark.parametrize("k", RESUMED)
def test_two_workers_resuming_step_k_end_on_the_uninterrupted_weights(runs, k):
    _, one, _, two = runs
    for rank, got in enumerate(two):
        same, grown = got["same"][k - 1], got["grown"][k - 1]
        assert same_weights(same, got["whole"]), (rank, k, max_relative(same, got["whole"]))
        assert max_relative(grown, one) <= EXACT_F64, (rank, k, max_relative(grown, one))  # 1 worker -> 2

"""``OmniLearnStrategy`` on 2 gloo ranks: what a plain Lightning DDP script would get, it gets (issue 32).

One spawn of 2 ranks runs a few short Lightning jobs; the tests read what each rank saw:

- ``trainer.predict`` is sharded as Lightning's ``DDPStrategy`` shards it
  (``UnrepeatedDistributedSamplerWrapper``): the two ranks together predict
  each of 21 samples once, none padded in twice.
- Validation inside ``fit`` sees the same BatchNorm statistics on every rank:
  ranks with unequal shares of a global batch of 32 (rank 1 3x slower, the
  split moved at step 3) on different samples, validated after step 5, inside
  a control interval (the buffers are made equal first, as at a checkpoint or
  at the HF door's evaluation).
- No batch setting: the global batch is the training ``DataLoader``'s
  ``batch_size`` x processes (8 x 2 = 16), as DDP's would be.
- ``Trainer(use_distributed_sampler=False)`` leaves validation unsharded
  (each rank all 20 samples), as under ``DDPStrategy``; by default each rank
  validates its 10.

Run: ``python -m pytest -q tests/dist/test_lightning_trust.py`` (about 20 s).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pl = pytest.importorskip("lightning.pytorch")
from omnilearn.integrations.lightning import OmniLearnStrategy  # noqa: E402
from test_lightning_exact import _join, fresh_port, spawn  # noqa: E402,F401  (fresh_port: autouse)

pytestmark = pytest.mark.dist

PREDICT_SAMPLES = 21


class Indices(pl.LightningModule):
    """Predicts the index of each sample it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(1, 1)

    def predict_step(self, batch, batch_idx):
        return batch[0].long().tolist()


class BatchNormNet(pl.LightningModule):
    """A BatchNorm model that keeps its running mean as each validation round begins."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
        self.at_validation: list[tuple] = []  # (step, interval ended, running mean)
        self.val_seen = 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        self.val_seen += len(batch[0])
        if batch_idx == 0 and self.trainer.state.fn == "fit":
            session = self.trainer.strategy.session
            self.at_validation.append((session.steps_done, session.interval_ended, self.net[1].running_mean.tolist()))
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def blobs(samples: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 4, generator=g) * torch.linspace(0.5, 4, samples).unsqueeze(1)  # samples differ in scale
    return TensorDataset(x, (x[:, 0] > 0).long())


def trainer(strategy: OmniLearnStrategy, **kwargs) -> pl.Trainer:
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0, **kwargs)


def _two_ranks(rank: int, store: str, out: str) -> None:
    _join(rank, 2, store)
    result = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        indices = TensorDataset(torch.arange(PREDICT_SAMPLES, dtype=torch.float32))
        predicted = trainer(OmniLearnStrategy()).predict(Indices(), DataLoader(indices, batch_size=4))
        result["predicted"] = [i for batch in predicted for i in batch]

        model = BatchNormNet()
        t = trainer(OmniLearnStrategy(global_batch=32, speeds="3,1", control_interval=3, min_batch=4), max_steps=6,
                    val_check_interval=5)
        t.fit(model, DataLoader(blobs(192, seed=0), batch_size=16, shuffle=True),
              DataLoader(blobs(20, seed=1), batch_size=10))
        result["at_validation"] = model.at_validation
        result["bn_batches"] = list(t.strategy.session.schedule.peek(4))

        t = trainer(OmniLearnStrategy(), max_steps=2)
        t.fit(BatchNormNet(), DataLoader(blobs(64, seed=0), batch_size=8, shuffle=True))
        result["default_global_batch"] = t.strategy.session.global_batch

        unsharded, val = BatchNormNet(), DataLoader(blobs(20, seed=1), batch_size=10)
        trainer(OmniLearnStrategy(), use_distributed_sampler=False).validate(unsharded, val, verbose=False)
        sharded = BatchNormNet()
        trainer(OmniLearnStrategy()).validate(sharded, val, verbose=False)
        result["val_seen"] = {"unsharded": unsharded.val_seen, "sharded": sharded.val_seen}
    torch.save(result, f"{out}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("lightning_trust")
    return spawn(_two_ranks, 2, out, "0.0001,0.0003", "rank")  # as speeds 3,1


def test_predict_is_sharded_each_sample_once_over_the_ranks(ranks):
    seen = [got["predicted"] for got in ranks]
    assert all(seen), seen  # both ranks predicted a part
    assert sorted(seen[0] + seen[1]) == list(range(PREDICT_SAMPLES)), seen


def test_validation_inside_fit_sees_equal_batchnorm_statistics_on_every_rank(ranks):
    fast, slow = ranks[0]["bn_batches"]
    assert fast > slow, (fast, slow)  # the ranks train on different shares of different samples: statistics differ
    zero, one = ranks[0]["at_validation"], ranks[1]["at_validation"]
    assert [(step, ended) for step, ended, _ in zero] == [(5, False)], zero  # inside a control interval of 3
    assert zero == one, (zero, one)


def test_no_batch_setting_takes_the_dataloaders_batch_size_times_processes(ranks):
    assert [got["default_global_batch"] for got in ranks] == [16, 16]  # DataLoader(batch_size=8) x 2 processes


def test_use_distributed_sampler_false_leaves_validation_unsharded_as_ddp_does(ranks):
    assert [got["val_seen"] for got in ranks] == [{"unsharded": 20, "sharded": 10}] * 2

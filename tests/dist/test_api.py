"""The public Python API (``omnilearn.setup``): one process, an existing process group, and torchrun.

Run: ``python -m pytest -q tests/dist/test_api.py`` (under a minute on 2 cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import omnilearn
from omnilearn.config import ConfigError
from omnilearn.observe.rundir import read_metrics
from omnilearn.data.plan import GlobalPlan

pytestmark = pytest.mark.dist
ROOT = Path(__file__).resolve().parents[2]


class ListData(torch.utils.data.Dataset):
    """A user's dataset: one sample per __getitem__, the DataLoader's default collate."""

    def __init__(self, n: int = 96, dim: int = 6, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x, self.y = torch.randn(n, dim, generator=g), torch.randint(3, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def test_single_process_trains_on_the_global_batches_in_plan_order():
    data = ListData()
    ol = omnilearn.setup(global_batch=32, control_interval=4, device="cpu")
    assert ol.world_size == 1
    torch.manual_seed(0)
    model = ol.wrap_model(nn.Linear(6, 3))
    torch.manual_seed(0)
    reference = nn.Linear(6, 3)
    loader = ol.data_loader(data)
    assert ol.batches == (32,) and len(loader) == 3
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    plan = GlobalPlan(len(data), 32, seed=0)
    for epoch in range(2):
        for k, (x, y) in enumerate(loader):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            ol.step(loss)
            idx = plan.step_indices(epoch * 3 + k)
            ref_loss = F.cross_entropy(reference(data.x[idx]), data.y[idx])
            ref_opt.zero_grad()
            ref_loss.backward()
            ref_opt.step()
    summary = ol.finish()
    assert summary["steps"] == 6 and summary["workers"][0]["mean_batch"] == 32
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b)


def test_misuse_gets_a_clear_error():
    ol = omnilearn.setup(global_batch=32, device="cpu")
    with pytest.raises(RuntimeError, match="data_loader"):
        ol.batches
    loader = ol.data_loader(ListData())
    with pytest.raises(RuntimeError, match="one training loader"):
        ol.data_loader(ListData())
    with pytest.raises(RuntimeError, match="without a batch"):
        ol.step()
    batches = iter(loader)
    next(batches)
    with pytest.raises(RuntimeError, match="never reported"):
        next(batches)
    with pytest.raises(ConfigError, match="workers=3"):
        omnilearn.setup(workers=3, device="cpu")
    with pytest.raises(ConfigError, match="global-batch"):
        omnilearn.setup(global_batch=512, device="cpu").data_loader(ListData(96))


def test_an_epoch_cut_short_counts_only_the_steps_run():
    ol = omnilearn.setup(global_batch=8, control_interval=3, device="cpu")
    model = ol.wrap_model(nn.Linear(6, 3))
    loader = ol.data_loader(ListData())
    for _ in range(3):
        for k, (x, y) in enumerate(loader):
            F.cross_entropy(model(x), y).backward()
            ol.step()
            if k == 1:
                break
    assert ol.finish()["steps"] == 6


class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))

    def forward(self, x):
        return self.body(x)


def _bn_worker(rank: int, store: str, out: str) -> None:
    # The user's own set-up: OmniLearn joins the group that already exists.
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    ol = omnilearn.setup(global_batch=48, speeds="3,1", control_interval=4, min_batch=4, device="cpu")
    torch.manual_seed(0)
    model = ol.wrap_model(BNNet())
    loader = ol.data_loader(ListData(480))
    ol.sync_buffers()  # before any step: the shares still sum to one, nothing is scaled
    assert torch.equal(ol.module.body[1].running_var, torch.ones(16))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(2):
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            ol.step(loss)
    ol.finish()
    torch.save({"buffers": {k: v for k, v in ol.module.state_dict().items() if "running" in k},
                "params": {k: v.detach() for k, v in ol.module.named_parameters()},
                "batches": ol.batches}, f"{out}/rank{rank}.pt")
    ol.close()


def test_existing_group_unequal_batches_and_batchnorm_buffers_agree(tmp_path):
    mp.start_processes(_bn_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, start_method="spawn")
    a, b = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    assert a["batches"] == b["batches"] and sum(a["batches"]) == 48
    assert a["batches"][0] > a["batches"][1]  # the emulated 3x slower worker got the smaller batch
    for key in ("buffers", "params"):
        for name in a[key]:
            torch.testing.assert_close(a[key][name], b[key][name], msg=f"{key} {name} differ between ranks")


def test_own_model_example_rebalances_under_torchrun(tmp_path):
    out = tmp_path / "example"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "examples" / "own_model.py"), "--speeds", "3,1", "--epochs", "2", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rebalances"] >= 1 and len(summary["workers"]) == 2
    changes = [d for d in read_metrics(out, "decision") if d["changed"]]
    assert changes and all(sum(d["new"]) == 128 for d in changes)
    assert changes[-1]["new"][0] > changes[-1]["new"][1]  # the fast worker carries more
    assert summary["test_accuracy"] > 0.4  # four classes: it learned something
    assert "final batches" in proc.stdout

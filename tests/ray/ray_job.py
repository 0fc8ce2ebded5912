"""The training function of the Ray door's tests: tests/faults/rescue_script.py's float64 MLP under ``TorchTrainer``.

``train_fn(config)`` is what a user writes (``omnilearn.setup()``, ``ol.wrap_model``, ``ol.data_loader``,
``ol_ray.resume`` and ``ol_ray.report``) plus a log and faults the tests drive through ``config``:

- ``out``: the log directory: ``events.jsonl`` (one JSON object a line, appended and flushed as it happens) and,
  at the end, rank 0's ``final.pt`` (the weights);
- ``steps``: the run's length (global batch 24 of 480 samples, control interval 4, the static split);
- ``every``: ``[[start, every], ...]``: an attempt that resumes at step ``start`` or later reports every ``every``
  steps (the last pair that applies);
- ``kills``: ``[K, ...]``: rank 1 SIGKILLs itself right after its ``optimizer.step()`` of step ``K`` (step K's
  update applied, not counted: the step in flight), once each (a marker file);
- ``holds``: ``[[step, world], ...]``: with ``world`` workers at ``ol.next_step == step``, every worker waits
  (at most :data:`HOLD_S`) for Ray to end the group: the test resizes the cluster meanwhile;
- ``refusals``: the first attempt calls Ray's ``prepare_model`` / ``prepare_data_loader`` first and logs how each
  was refused.

Events (rank 0's unless said): ``start`` (step, world, t, batches), ``step`` (step: steps done after it, world, t,
s: its seconds without the report, batches), ``report`` (step, s: the report's seconds), ``kill`` (the killed
rank's: applied, t), ``hold`` (step, world, t), ``refused`` (name, message), ``end`` (t).

Run: ``python -m pytest -q tests/ray/``
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

SAMPLES, GLOBAL_BATCH, INTERVAL = 480, 24, 4
HOLD_S = 240.0  # a hang guard: Ray ends a held group well within it


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(SAMPLES, 8, generator=g, dtype=torch.float64),
                         torch.randn(SAMPLES, 1, generator=g, dtype=torch.float64))


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    return net.to(torch.float64)


def plain_weights(steps: int) -> dict[str, torch.Tensor]:
    """The uninterrupted run: one plain process on the global batches every session takes (``GlobalPlan``)."""
    from omnilearn.data.schedule import GlobalPlan

    data, net = dataset(), model()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    plan = GlobalPlan(SAMPLES, GLOBAL_BATCH, seed=0)
    for step in range(steps):
        x, y = data[torch.as_tensor(plan.step_indices(step))]
        opt.zero_grad()
        F.mse_loss(net(x), y).backward()
        opt.step()
    return {k: v.detach() for k, v in net.state_dict().items()}


def rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The relative distance of two models' weights (the norm over every tensor)."""
    num = sum(float(((a[k] - b[k]) ** 2).sum()) for k in a) ** 0.5
    return num / sum(float((a[k] ** 2).sum()) for k in a) ** 0.5


class Log:
    def __init__(self, out: Path, rank: int) -> None:
        self.path, self.rank = out / "events.jsonl", rank

    def __call__(self, event: str, everyone: bool = False, **fields) -> None:
        if self.rank == 0 or everyone:
            with open(self.path, "a") as f:
                f.write(json.dumps({"event": event, "rank": self.rank, **fields}) + "\n")


def read_events(out: Path) -> list[dict]:
    path = out / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def refusals(log: Log) -> None:
    """Ray's own data-parallel helpers, called in a session: each one refused in one line."""
    import ray.train.torch

    from omnilearn.config import ConfigError

    for name, arg in (("prepare_model", torch.nn.Linear(2, 2)), ("prepare_data_loader", DataLoader(dataset()))):
        try:
            getattr(ray.train.torch, name)(arg)
        except ConfigError as e:
            log("refused", name=name, message=str(e))
        else:
            log("refused", name=name, message=None)


def train_fn(config: dict) -> None:
    import omnilearn
    from omnilearn.integrations import ray as ol_ray

    out = Path(config["out"])
    ol = omnilearn.setup(global_batch=GLOBAL_BATCH, control_interval=INTERVAL, controller="static", device="cpu",
                         total_steps=config["steps"])
    log = Log(out, ol.rank)
    net = ol.wrap_model(model())
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    loader = ol.data_loader(dataset())
    resumed = ol_ray.resume(ol, model=ol.module, optimizer=opt)
    if config.get("refusals") and not resumed:
        refusals(log)
    every = [e for start, e in config.get("every", [[0, 4]]) if ol.next_step >= start][-1]
    holds = {tuple(h) for h in config.get("holds", [])}
    log("start", step=ol.next_step, world=ol.world_size, t=time.time(), batches=list(ol.batches), every=every)
    while ol.next_step < config["steps"]:
        loader.set_epoch(ol.epoch)
        for x, y in loader:
            began = time.perf_counter()
            step = ol.next_step
            loss = F.mse_loss(net(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step in config.get("kills", []) and ol.rank == 1 and not (out / f"killed-{step}").exists():
                (out / f"killed-{step}").touch()
                log("kill", everyone=True, applied=step + 1, t=time.time())
                os.kill(os.getpid(), signal.SIGKILL)
            ol.step(loss)
            log("step", step=ol.next_step, world=ol.world_size, t=time.time(), s=time.perf_counter() - began,
                batches=list(ol.batches))
            began = time.perf_counter()
            if ol_ray.report(ol, {"loss": loss.item()}, model=ol.module, optimizer=opt, every=every):
                log("report", step=ol.next_step, s=time.perf_counter() - began)
            if (ol.next_step, ol.world_size) in holds:
                log("hold", step=ol.next_step, world=ol.world_size, t=time.time())
                threading.Event().wait(HOLD_S)  # Ray ends this group (the test resizes the cluster) long before
            if ol.next_step >= config["steps"]:
                break
    ol.finish()
    if ol.is_main:
        torch.save(ol.module.state_dict(), out / "final.pt")
    log("end", t=time.time())
    ol.close()

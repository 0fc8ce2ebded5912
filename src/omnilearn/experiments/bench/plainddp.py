"""The plain-DDP baseline for ``omnilearn bench``: no OmniLearn code in the training loop.

Same model, data, global batch, optimizer and schedule as an OmniLearn run,
but the way most PyTorch users write it: ``DistributedSampler``, equal
batches of ``B / n``, ``DistributedDataParallel`` with its default averaging.
Only wall time is measured, around the loop and never inside a step: the
whole loop, and the bench's steady range (from
:func:`~omnilearn.experiments.bench.stats.steady_range_start` to the end, the
range the OmniLearn arms report) as ``steady_step_s``, so the bench can
compare OmniLearn's per-step overhead at HL1 against it.
"""

from __future__ import annotations

import time
from pathlib import Path

from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from omnilearn.experiments.datasets import core as data

from omnilearn.experiments.train import workload
from omnilearn.experiments.bench.stats import steady_range_start
from omnilearn.experiments.config import TrainConfig
from omnilearn.distributed.group import DistContext
from omnilearn.observe.rundir import write_json
from omnilearn.experiments.train.workload import resolve


def train_plain_ddp(cfg: TrainConfig, ctx: DistContext, run_dir: Path | None) -> dict | None:
    splits = workload.load_data(cfg)
    if cfg.global_batch % ctx.world_size:
        raise ValueError(f"plain DDP needs --global-batch divisible by {ctx.world_size} workers")
    run = resolve(cfg, len(splits.train))
    total = run.total_steps  # exactly as many steps as the OmniLearn arms
    model = workload.build_model(cfg, splits).to(ctx.device)
    ddp = DDP(model, device_ids=[ctx.device] if ctx.device.type == "cuda" else None)
    opt = workload.make_optimizer(cfg, ddp.parameters())
    sched = workload.make_schedule(cfg, opt, total, run.steps_per_epoch)
    sampler = DistributedSampler(splits.train, ctx.world_size, ctx.rank, shuffle=True, seed=cfg.seed, drop_last=True)
    loader = DataLoader(splits.train, batch_size=cfg.global_batch // ctx.world_size, sampler=sampler,
                        drop_last=True, collate_fn=data.keep_batch)
    first = steady_range_start(total, run.steps_per_epoch)
    step, epoch, start = 0, 0, time.perf_counter()
    steady = start
    while step < total:
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = workload.criterion(ddp(x.to(ctx.device)), y.to(ctx.device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            if step == first:  # after step first - 1, as the OmniLearn arms read their clock at an epoch's end
                ctx.synchronize()
                steady = time.perf_counter()
            if step == total:
                break
        epoch += 1
    ctx.synchronize()
    end = time.perf_counter()
    train_s = end - start
    _, accuracy = workload.evaluate(model, splits.test, ctx)  # a collective: every rank takes part
    if run_dir is None:
        return None
    summary = {"controller": "ddp", "steps": total, "train_s": train_s, "wall_step_s": train_s / total,
               "samples_per_s": total * cfg.global_batch / train_s, "test_accuracy": accuracy,
               "steady_from_step": first, "steady_step_s": (end - steady) / (total - first)}
    write_json(run_dir / "summary.json", summary)
    return summary

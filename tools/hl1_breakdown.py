"""Where a step's time goes with nothing to balance (HL1): plain DDP against OmniLearn's API loop (issue 23, part 1).

Both loops run in the same processes, in interleaved blocks (plain, OmniLearn, plain, ...), on the default job's
workload (MNIST-1D, cnn1d, SGD, global batch 256) at equal speeds. Every rank times each part of its loop with
``time.perf_counter`` (CPU: no device sync needed), and each block's wall time between two barriers:

- plain DDP: ``fetch`` (the next batch of a ``DataLoader`` over a ``DistributedSampler``), ``fwd+bwd`` (forward,
  loss, backward: DDP's all-reduce inside), ``opt`` (``zero_grad`` and ``step``);
- OmniLearn: the same, with ``ol.data_loader`` and ``ol.wrap_model`` (the weighted comm hook), plus ``ol.step``
  (the step clock, the ledger, this rank's row, and every interval end: the all-gather, the decision, the
  reductions of the totals; at a third of an interval, the mid-interval check).
- ``+ run dir``: the OmniLearn loop again with a run directory (``out=``), as ``omnilearn train`` writes one:
  rank 0's records and console, every rank's step rows.

First it times one all-gather of a 12-number row (what each of OmniLearn's meetings sends) in a tight loop: the
latency of one collective on this machine with this many processes. Per control interval of 15 steps OmniLearn
adds five collectives to DDP's: the interval end's all-gather, two mid-interval checks (all-gathers) and the two
reductions of the per-step totals to rank 0.

With ``--device cuda`` (NCCL, one GPU per rank) the batches move to the rank's GPU; each block's wall time is
taken after a device synchronisation at its end, and the per-part times are then the host's (kernel launches and
Python, not the GPU's work): what a step with short kernels pays in host time per part.

A benchmark, not a test: run it alone on the machine. It prints per-part milliseconds per step (mean over the
ranks and blocks), the wall per step of each loop and the ratio per pair of blocks.

    torchrun --standalone --nproc-per-node 4 tools/hl1_breakdown.py [--blocks 6] [--steps 150] [--device cuda]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

import omnilearn
from omnilearn.experiments.config import TrainConfig
from omnilearn.experiments.datasets import core as data
from omnilearn.experiments.train import workload

GLOBAL_BATCH = 256


class Parts:
    """Seconds per named part, summed over a block's steps."""

    def __init__(self) -> None:
        self.s: dict[str, float] = defaultdict(float)
        self.t = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.s[name] += now - self.t
        self.t = now


def batches(loader, steps: int, set_epoch):
    """``steps`` batches, over as many epochs as it takes."""
    done, epoch = 0, 0
    while True:
        set_epoch(epoch)
        for batch in loader:
            yield batch
            done += 1
            if done == steps:
                return
        epoch += 1


def settle(device: torch.device) -> None:
    """Wait for this rank's device work, then for every rank."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def timed_loop(model, opt, stream, device: torch.device, after=None) -> tuple[float, dict[str, float]]:
    """Train on ``stream``'s batches; the wall time between two barriers and each part's seconds on this rank.
    ``after(loss)``: what the loop calls once a step's optimizer step is done (``ol.step``)."""
    settle(device)
    start = time.perf_counter()
    parts = Parts()
    for x, y in stream:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        parts.lap("fetch")
        loss = workload.criterion(model(x), y)
        loss.backward()
        parts.lap("fwd+bwd")
        opt.step()
        opt.zero_grad(set_to_none=True)
        parts.lap("opt")
        if after is not None:
            after(loss)
            parts.lap("ol.step")
    settle(device)
    return time.perf_counter() - start, dict(parts.s)


def plain_block(cfg: TrainConfig, splits, steps: int) -> tuple[float, dict[str, float]]:
    world, rank, device = dist.get_world_size(), dist.get_rank(), rank_device(cfg)
    torch.manual_seed(cfg.seed)
    model = DDP(workload.build_model(cfg, splits).to(device), device_ids=[device] if device.type == "cuda" else None)
    opt = workload.make_optimizer(cfg, model.parameters())
    sampler = DistributedSampler(splits.train, world, rank, shuffle=True, seed=cfg.seed, drop_last=True)
    loader = DataLoader(splits.train, batch_size=GLOBAL_BATCH // world, sampler=sampler, drop_last=True,
                        collate_fn=data.keep_batch)
    return timed_loop(model, opt, batches(loader, steps, sampler.set_epoch), device)


def omni_block(cfg: TrainConfig, splits, steps: int, out: str | None = None) -> tuple[float, dict[str, float]]:
    ol = omnilearn.setup(global_batch=GLOBAL_BATCH, controller="uniform", control_interval=cfg.control_interval,
                         device=cfg.device, handle_signals=False, total_steps=steps, out=out)
    torch.manual_seed(cfg.seed)
    model = ol.wrap_model(workload.build_model(cfg, splits).to(ol.device))
    opt = workload.make_optimizer(cfg, model.parameters())
    loader = ol.data_loader(splits.train, collate_fn=data.keep_batch)
    try:
        return timed_loop(model, opt, batches(loader, steps, loader.set_epoch), ol.device, after=ol.step)
    finally:
        ol.release()


def rank_device(cfg: TrainConfig) -> torch.device:
    return torch.device("cuda", dist.get_rank() % max(1, torch.cuda.device_count())) if cfg.device == "cuda" \
        else torch.device("cpu")


def collective_ms(device: torch.device, reps: int = 200) -> float:
    """Median ms of one all-gather of 12 float64 per rank (the row of a meeting), mean over the ranks."""
    row = torch.zeros(12, dtype=torch.float64, device=device)
    parts = [torch.empty_like(row) for _ in range(dist.get_world_size())]
    times = []
    for i in range(reps + 20):
        start = time.perf_counter()
        dist.all_gather(parts, row)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= 20:
            times.append(time.perf_counter() - start)
    median = torch.tensor([statistics.median(times) * 1e3], device=device)
    dist.all_reduce(median)
    return float(median) / dist.get_world_size()


def run_dir_block(cfg: TrainConfig, splits, steps: int) -> tuple[float, dict[str, float]]:
    """OmniLearn's loop writing a run directory, as ``omnilearn train`` does (records, rank files, console)."""
    with tempfile.TemporaryDirectory() as tmp:
        mine = tmp if dist.get_rank() == 0 else None
        return omni_block(cfg, splits, steps, out=mine)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=6, help="pairs of blocks (plain, OmniLearn), interleaved")
    ap.add_argument("--steps", type=int, default=150, help="steps per block")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: NCCL, one GPU per rank")
    args = ap.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < int(os.environ.get("LOCAL_WORLD_SIZE", "1")):
        ap.error(f"--device cuda needs one GPU per rank: {torch.cuda.device_count()} GPUs here; use --device cpu")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    torch.set_num_threads(1)
    cfg = TrainConfig(workers=dist.get_world_size(), global_batch=GLOBAL_BATCH, device=args.device)
    if args.device == "cuda":
        torch.cuda.set_device(rank_device(cfg))
    splits = workload.load_data(cfg)
    plain_block(cfg, splits, 30)  # warm-up, unmeasured
    latency = collective_ms(rank_device(cfg))
    walls: dict[str, list[float]] = defaultdict(list)
    parts: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for _ in range(args.blocks):
        for name, block in (("plain DDP", plain_block), ("OmniLearn", omni_block), ("+ run dir", run_dir_block)):
            wall, mine = block(cfg, splits, args.steps)
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)
            walls[name].append(wall / args.steps)
            for part in mine:
                parts[name][part].append(statistics.fmean(r[part] for r in every) / args.steps)
    if dist.get_rank() == 0:
        print(f"{dist.get_world_size()} ranks on {args.device}: one all-gather of a 12-number row takes "
              f"{latency:.3f} ms (median)")
        print(f"{dist.get_world_size()} ranks, {args.blocks} x {args.steps} steps per loop, ms per step "
              "(parts: mean over ranks and blocks)")
        for name, wall in walls.items():
            summed = sum(statistics.fmean(v) for v in parts[name].values())
            print(f"{name:10s} wall {statistics.fmean(wall) * 1e3:6.2f} | "
                  + " | ".join(f"{p} {statistics.fmean(v) * 1e3:6.2f}" for p, v in parts[name].items())
                  + f" | parts summed {summed * 1e3:6.2f}")
        for name in ("OmniLearn", "+ run dir"):
            ratios = [o / p for p, o in zip(walls["plain DDP"], walls[name])]
            print(f"{name} / plain DDP per block: " + ", ".join(f"{r:.3f}" for r in ratios)
                  + f" (mean {statistics.fmean(ratios):.3f})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""OmniLearn's host cost over plain DDP with nothing to balance (HL1): both loops, interleaved, in the same processes.

Plain DDP and OmniLearn's API loop are built once per process, each with its own model, optimizer and loader,
and trained in alternating blocks of ``--steps`` steps (plain, OmniLearn, plain, ...), so a slow moment of the
machine falls on both alike. The workload is the default job's data (MNIST-1D) with ``--model`` (``cnn1d``: the
default job's; ``mlp``: a tiny model, so a step is mostly host time) at equal speeds, SGD, ``--global-batch``.
Every rank times each part of its loop with ``time.perf_counter`` (CPU: no device sync needed) and with its main
thread's CPU time (``time.thread_time``: a part's own work, without the waits for a peer that a synchronised loop
moves from one part to another), and each block's wall time between two barriers:

- plain DDP: ``fetch`` (the next batch of a ``DataLoader`` over a ``DistributedSampler``), ``fwd+bwd`` (forward,
  loss, backward: DDP's all-reduce inside), ``opt`` (``step`` and ``zero_grad``);
- OmniLearn: the same, with ``ol.data_loader`` and ``ol.wrap_model``, plus ``ol.step`` (the step clock, the
  ledger, and at window ends the meetings, the decision and the totals).

It prints the parts in microseconds per step (mean over ranks, median over blocks; ``cpu``: the main thread's CPU
time), each pair's ratio of wall times (OmniLearn / plain), their median with its 95% interval (the pairs
resampled: what this many pairs can resolve), and the median extra microseconds per step. ``--profile N``: rank 0
runs N more OmniLearn steps under cProfile and prints the N functions with the most own time (the profile of
the hot path). ``--window-cost N``: then N more OmniLearn steps with the window ends' two parts timed in the main
thread's CPU (the meeting started at a window's last step, ``_end_interval``; read, decided and recorded at the
next, ``_read_meeting``): per window end and per step (the median over blocks above mostly leaves them out: a
window spans several blocks). With ``--device cuda`` (NCCL, one GPU per rank) each block ends with a device
synchronisation and the parts are host times.

A benchmark, not a test: run it alone on the machine (``OMP_NUM_THREADS=1``: one core per rank).

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 tools/hl1_breakdown.py --model mlp [--aa]

``--aa``: the A/A control, both loops plain DDP (what the ratio reads with nothing to find: its own spread).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import random
import statistics
import sys
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


class Parts:
    """Seconds per named part, summed over a block's steps: wall time, and the main thread's CPU time (what this
    rank itself spent there: waiting for a peer in a collective costs wall time, not CPU)."""

    def __init__(self) -> None:
        self.s: dict[str, float] = defaultdict(float)
        self.t, self.cpu = time.perf_counter(), time.thread_time()

    def lap(self, name: str) -> None:
        now, cpu = time.perf_counter(), time.thread_time()
        self.s[name] += now - self.t
        self.s[f"{name} cpu"] += cpu - self.cpu
        self.t, self.cpu = now, cpu


def forever(loader, set_epoch):
    """The loader's batches, epoch after epoch."""
    epoch = 0
    while True:
        set_epoch(epoch)
        yield from loader
        epoch += 1


def settle(device: torch.device) -> None:
    """Wait for this rank's device work, then for every rank."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


class Loop:
    """One training loop (model, optimizer, endless batches); :meth:`block` trains ``steps`` of it, timed."""

    def __init__(self, model, opt, stream, device: torch.device, after=None) -> None:
        self.model, self.opt, self.stream, self.device, self.after = model, opt, stream, device, after

    def block(self, steps: int) -> tuple[float, dict[str, float]]:
        settle(self.device)
        start = time.perf_counter()
        parts = Parts()
        for _ in range(steps):
            self.step(parts)
        settle(self.device)
        return time.perf_counter() - start, dict(parts.s)

    def step(self, parts: Parts) -> None:
        x, y = next(self.stream)
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        parts.lap("fetch")
        loss = workload.criterion(self.model(x), y)
        loss.backward()
        parts.lap("fwd+bwd")
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        parts.lap("opt")
        if self.after is not None:
            self.after(loss)
            parts.lap("ol.step")


def plain_loop(cfg: TrainConfig, splits, device: torch.device) -> Loop:
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(cfg.seed)
    model = DDP(workload.build_model(cfg, splits).to(device), device_ids=[device] if device.type == "cuda" else None)
    opt = workload.make_optimizer(cfg, model.parameters())
    sampler = DistributedSampler(splits.train, world, rank, shuffle=True, seed=cfg.seed, drop_last=True)
    loader = DataLoader(splits.train, batch_size=cfg.global_batch // world, sampler=sampler, drop_last=True,
                        collate_fn=data.keep_batch, pin_memory=device.type == "cuda")  # as ol.data_loader's default
    return Loop(model, opt, forever(loader, sampler.set_epoch), device)


def omni_loop(cfg: TrainConfig, splits, total_steps: int):
    ol = omnilearn.setup(global_batch=cfg.global_batch, controller="uniform", control_interval=cfg.control_interval,
                         device=cfg.device, handle_signals=False, total_steps=total_steps)
    torch.manual_seed(cfg.seed)
    model = ol.wrap_model(workload.build_model(cfg, splits).to(ol.device))
    opt = workload.make_optimizer(cfg, model.parameters())
    loader = ol.data_loader(splits.train, collate_fn=data.keep_batch)
    return ol, Loop(model, opt, forever(loader, loader.set_epoch), ol.device, after=ol.step)


def rank_device(cfg: TrainConfig) -> torch.device:
    return torch.device("cuda", dist.get_rank() % max(1, torch.cuda.device_count())) if cfg.device == "cuda" \
        else torch.device("cpu")


def profile(loop: Loop, steps: int, top: int) -> str:
    """rank 0: ``steps`` OmniLearn steps under cProfile, the ``top`` functions by own time (the others just train)."""
    parts = Parts()
    if dist.get_rank() != 0:
        for _ in range(steps):
            loop.step(parts)
        return ""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        loop.step(parts)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def spread(values: list[float], draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """The 95% interval of ``values``' median, by resampling them (the pairs) with replacement ``draws`` times: how
    far the median itself may be off with this many pairs on this machine (an A/A run shows the same)."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
    return medians[int(0.025 * draws)], medians[int(0.975 * draws) - 1]


def window_cost(ol, loop: Loop, steps: int) -> str:
    """``steps`` OmniLearn steps with the session's two window-end methods timed (main thread's CPU), on each rank;
    rank 0's reading: microseconds per window end and per step."""
    spent: dict[str, list[float]] = defaultdict(list)
    session = type(ol)
    originals = {name: getattr(session, name) for name in ("_end_interval", "_read_meeting")}

    def timed(name, fn):
        def run(self, *args):
            cpu = time.thread_time()
            try:
                return fn(self, *args)
            finally:
                spent[name].append(time.thread_time() - cpu)
        return run

    for name, fn in originals.items():
        setattr(session, name, timed(name, fn))
    try:
        parts = Parts()
        for _ in range(steps):
            loop.step(parts)
    finally:
        for name, fn in originals.items():
            setattr(session, name, fn)
    ends = len(spent["_end_interval"]) or 1
    each = {name: sum(spent[name]) / ends * 1e6 for name in originals}
    total = sum(each.values())
    return (f"window ends: {len(spent['_end_interval'])} in {steps} steps; main thread's CPU per window end "
            + ", ".join(f"{name} {us:.0f} us" for name, us in each.items())
            + f": {total:.0f} us, {total * len(spent['_end_interval']) / steps:.1f} us per step")


def check_args(ap: argparse.ArgumentParser, args: argparse.Namespace, at_least_one: tuple[str, ...],
               zero_or_more: tuple[str, ...]) -> None:
    """Refuse in one line (argparse's error: exit 2, no traceback) a count out of range, or a run outside torchrun,
    before any process group."""
    for names, low, what in ((at_least_one, 1, "1 or more"), (zero_or_more, 0, "a number of steps, 0 or more")):
        for name in names:
            if getattr(args, name) < low:
                ap.error(f"--{name.replace('_', '-')} {getattr(args, name)}: give {what}")
    if "RANK" not in os.environ:
        ap.error(f"no RANK in the environment: run it under torchrun, e.g. OMP_NUM_THREADS=1 torchrun --standalone "
                 f"--nproc-per-node 2 {os.path.relpath(sys.argv[0])}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=100, help="pairs of blocks (plain, OmniLearn), interleaved "
                    "(many short pairs: the median of 12 long ones moved by up to 7%% between two A/A runs here)")
    ap.add_argument("--steps", type=int, default=30, help="steps per block")
    ap.add_argument("--model", default="cnn1d", help="cnn1d (the default job's) or mlp (tiny: mostly host time)")
    ap.add_argument("--global-batch", type=int, default=256)
    ap.add_argument("--control-interval", type=int, default=TrainConfig.control_interval,
                    help="OmniLearn's steps per control interval (meetings: its end and a check at each third)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: NCCL, one GPU per rank")
    ap.add_argument("--aa", action="store_true",
                    help="A/A control: the second loop is plain DDP too (the spread of the ratio with nothing to find)")
    ap.add_argument("--window-cost", type=int, default=0, metavar="N",
                    help="then N OmniLearn steps with the window ends timed: CPU per window end and per step")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="then N OmniLearn steps under cProfile on rank 0: the N functions with the most own time")
    args = ap.parse_args()
    if args.aa and args.window_cost:
        ap.error("--window-cost times OmniLearn's window ends, and --aa runs no OmniLearn loop: drop one of them")
    check_args(ap, args, ("blocks", "steps", "global_batch", "control_interval"), ("window_cost", "profile"))
    if args.device == "cuda" and torch.cuda.device_count() < int(os.environ.get("LOCAL_WORLD_SIZE", "1")):
        ap.error(f"--device cuda needs one GPU per rank: {torch.cuda.device_count()} GPUs here; use --device cpu")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    torch.set_num_threads(1)
    cfg = TrainConfig(workers=dist.get_world_size(), global_batch=args.global_batch, device=args.device,
                      model=args.model, control_interval=args.control_interval)
    device = rank_device(cfg)
    if args.device == "cuda":
        torch.cuda.set_device(device)
    splits = workload.load_data(cfg)
    plain = plain_loop(cfg, splits, device)
    ol, omni = omni_loop(cfg, splits, (args.blocks + 1) * args.steps + args.profile + args.window_cost + 10)
    if args.aa:
        omni = plain_loop(cfg, splits, device)
    SECOND = "plain DDP'" if args.aa else "OmniLearn"  # noqa: N806  (the second loop's label)
    plain.block(args.steps // 2)  # warm-up of both, unmeasured
    omni.block(args.steps // 2)
    walls: dict[str, list[float]] = defaultdict(list)
    parts: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for _ in range(args.blocks):
        for name, loop in (("plain DDP", plain), (SECOND, omni)):
            wall, mine = loop.block(args.steps)
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)
            walls[name].append(wall / args.steps)
            for part in mine:
                parts[name][part].append(statistics.fmean(r[part] for r in every) / args.steps)
    windows = window_cost(ol, omni, args.window_cost) if args.window_cost else ""
    table = profile(omni, args.profile, args.profile) if args.profile else ""
    ol.release()
    if dist.get_rank() == 0:
        print(f"{dist.get_world_size()} ranks on {args.device}, model {args.model}, global batch {args.global_batch}, "
              f"control interval {args.control_interval}: "
              f"{args.blocks} x {args.steps} steps per loop, interleaved; us per step (parts: mean over ranks, "
              "median over blocks)")
        for name, wall in walls.items():
            for kind in ("wall", "cpu"):
                shown = {p: v for p, v in parts[name].items() if p.endswith(" cpu") == (kind == "cpu")}
                total = statistics.median(wall) if kind == "wall" else sum(map(statistics.median, shown.values()))
                print(f"{name:10s} {kind:4s} {total * 1e6:7.0f} | " + " | ".join(
                    f"{p.removesuffix(' cpu')} {statistics.median(v) * 1e6:6.0f}" for p, v in shown.items()))
        ratios = [o / p for p, o in zip(walls["plain DDP"], walls[SECOND])]
        extra = [(o - p) * 1e6 for p, o in zip(walls["plain DDP"], walls[SECOND])]
        cpu = {name: [sum(block) for block in zip(*(v for p, v in parts[name].items() if p.endswith(" cpu")))]
               for name in walls}
        extra_cpu = [(o - p) * 1e6 for p, o in zip(cpu["plain DDP"], cpu[SECOND])]
        print(f"{SECOND} / plain DDP per pair: " + ", ".join(f"{r:.3f}" for r in ratios))
        base_cpu = statistics.median(cpu["plain DDP"]) * 1e6
        low, high = spread(ratios)
        cpu_low, cpu_high = spread(extra_cpu)
        share = statistics.median(extra_cpu) / base_cpu
        print(f"median ratio {statistics.median(ratios):.3f} (95% interval {low:.3f}-{high:.3f}; "
              f"min {min(ratios):.3f}, max {max(ratios):.3f}); median extra {statistics.median(extra):+.0f} us "
              f"per step (main thread's CPU: {statistics.median(extra_cpu):+.0f} us, {share:+.1%} of plain's, "
              f"95% interval {cpu_low / base_cpu:+.1%} to {cpu_high / base_cpu:+.1%})")
        if windows:
            print(windows)
        if table:
            print(table)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

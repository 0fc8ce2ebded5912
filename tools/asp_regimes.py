"""Where does uniform ASP's staleness cost accuracy? An event-driven ASP run on a virtual clock.

The real bench (``omnilearn bench --mode asp``) runs every worker as a process: on a 2-core host eight
workers or more share two cores, so the delay emulator's speeds are squeezed (at 1:2:...:8 uniform's push
rates spread 1.8x, not 8x: docs/asp.md). This tool keeps the training real and the time virtual, so the
worker count and the spread are what you ask for:

- one process; the default job's model and data (MNIST-1D ``cnn1d``, the embedded default), plain SGD (or
  ``--momentum``) on the server's weights, as ``omnilearn train --mode asp`` applies pushes;
- worker ``i`` takes ``(fixed_ms + sample_ms x b_i) x s_max / s_i`` of virtual time per push; it pulls the
  weights when it starts a push and its gradient is computed on that copy, so staleness is what it would be;
- the same pieces as the server (:mod:`omnilearn.asp`): the ``IndexDealer`` (every sample once per epoch),
  ``push_lr`` (``uniform``: no scaling; ``omnilearn``: linear ``b_i / b_ref``; ``omnilearn-none``: balanced
  batches, no scaling), ``Staleness``, and the
  controller (``PushControl`` over ``push_loop``) fed the virtual cycle times;
- an evaluation after every epoch dealt; each arm runs ``--epochs``. Reported per arm: accuracy at equal
  epochs (mean of the last 3 evaluations), at equal virtual time (the shorter arm's end: the last 3 evaluations
  at or before it) and the staleness p50/p99/max (all pushes; the slowest worker's).

Not modelled: the server's own time (pushes are applied the instant they arrive), network time.

    python tools/asp_regimes.py --workers 16 --speeds geometric:8 --lr 0.15 --seeds 3
    python tools/asp_regimes.py --workers 4 --speeds 4,4,4,28 --epochs 30 --seeds 3   # the ASP HL8 table
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import math
import sys
import time
from statistics import fmean

import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from omnilearn.asp.control import PushControl, push_loop
from omnilearn.asp.rules import IndexDealer, Staleness, push_lr
from omnilearn.config import BalanceConfig
from omnilearn.emulation.speeds import ASP_LEVELS, SpeedError, parse_speeds
from omnilearn.experiments.config import TrainConfig
from omnilearn.experiments.train import workload

# arm: (controller, learning-rate scaling); the first two as the bench runs them
ARMS = {"uniform": ("uniform", "none"), "omnilearn": ("omnilearn", "linear"), "omnilearn-none": ("omnilearn", "none")}


def speeds_of(text: str, workers: int) -> tuple[float, ...]:
    """``geometric:H`` (speeds from 1 to ``H``, evenly spread in log), ``linear:H``, or a list / ASP level."""
    kind, _, top = text.partition(":")
    if kind in ("geometric", "linear") and top:
        high = float(top)
        if not (math.isfinite(high) and high >= 1) or workers < 2:
            raise SystemExit(f"asp_regimes: --speeds {text!r}: give H >= 1 and at least 2 workers")
        at = [i / (workers - 1) for i in range(workers)]
        return tuple(high ** a if kind == "geometric" else 1 + (high - 1) * a for a in at)
    return parse_speeds(text, workers, ASP_LEVELS)


@dataclasses.dataclass
class Worker:
    weights: torch.Tensor  # the weights it pulled
    version: int
    epoch: int
    indices: list[int]
    started: float


def run_arm(arm: str, args, speeds: tuple[float, ...], seed: int, splits) -> dict:
    """One arm, one seed: every push on the virtual clock; evaluations after each epoch dealt."""
    n, top = len(speeds), max(speeds)
    cfg = TrainConfig(model=args.model, seed=seed, workers=n, global_batch=args.global_batch, lr=args.lr,
                      momentum=args.momentum)
    server = workload.build_model(cfg, splits)
    scratch = workload.build_model(cfg, splits)
    params = [p for p in server.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=args.lr, momentum=args.momentum)
    controller, scaling = ARMS[arm]
    balance = BalanceConfig(workers=n, global_batch=args.global_batch, seed=seed, controller=controller,
                            min_batch=args.min_batch, control_interval=args.control_interval)
    total = args.epochs * len(splits.train) // max(1, args.global_batch // n) + n
    control = PushControl(push_loop(balance, speeds, total, range(n)), balance.control_interval)
    dealer, stale = IndexDealer(len(splits.train), seed), Staleness(n)
    b_ref, version, clock = args.global_batch / n, 0, 0.0
    events: list[tuple[float, int]] = []
    inflight: dict[int, Worker] = {}
    evals: list[tuple[int, float, float]] = []  # (epoch, virtual s, accuracy)
    pushes = [0] * n

    def start(worker: int) -> None:
        epoch, indices = dealer.deal(control.batches[worker])
        inflight[worker] = Worker(parameters_to_vector(params).detach().clone(), version, epoch, indices, clock)
        cycle = (args.fixed_ms + args.sample_ms * len(indices)) * top / speeds[worker] / 1e3
        heapq.heappush(events, (clock + cycle, worker))

    for w in range(n):
        start(w)
    while dealer.epochs_done < args.epochs:
        clock, worker = heapq.heappop(events)
        job = inflight.pop(worker)
        vector_to_parameters(job.weights, scratch.parameters())
        scratch.zero_grad(set_to_none=True)
        x, y = splits.train.__getitems__(job.indices)
        workload.criterion(scratch(x), y).backward()
        grad = parameters_to_vector([p.grad for p in scratch.parameters() if p.requires_grad])
        if not torch.isfinite(grad).all():
            return {"arm": arm, "seed": seed, "diverged_at_epoch": job.epoch, "evals": evals}
        s = stale.record(worker, version, job.version)
        lr = push_lr(args.lr, len(job.indices), b_ref, s, scaling, False)
        for p, g in zip(params, torch.split(grad * (lr / args.lr), [p.numel() for p in params])):
            p.grad = g.view_as(p)
        opt.step()
        version += 1
        pushes[worker] += 1
        if control.record(worker, len(job.indices), clock - job.started):
            control.decide(version)
        done = math.floor(dealer.epochs_done)
        if dealer.cursor >= len(splits.train) and (not evals or evals[-1][0] < done):
            evals.append((done, clock, accuracy(server, splits)))
        start(worker)
    if not evals or evals[-1][0] < args.epochs:
        evals.append((args.epochs, clock, accuracy(server, splits)))
    return {"arm": arm, "seed": seed, "evals": evals, "virtual_s": clock, "batches": list(control.batches),
            "pushes": pushes, "p50": stale.quantile(0.5), "p99": stale.quantile(0.99),
            "max": stale.quantile(1.0), "slowest_p99": stale.quantile(0.99, speeds.index(min(speeds)))}


@torch.no_grad()
def accuracy(model, splits) -> float:
    model.eval()
    x, y = splits.test.__getitems__(list(range(len(splits.test))))
    acc = (model(x).argmax(-1) == y).float().mean().item()
    model.train()
    return acc


def last3(values: list[float]) -> float | None:
    return fmean(values[-3:]) if values else None


def figures(results: list[dict]) -> dict:
    """Per arm: accuracy at equal epochs and at equal virtual time (mean, min, max over seeds), staleness."""
    out: dict[str, dict] = {}
    by_seed: dict[int, list[dict]] = {}
    for r in results:
        by_seed.setdefault(r["seed"], []).append(r)
    for arm in dict.fromkeys(r["arm"] for r in results):
        mine = [r for r in results if r["arm"] == arm]
        epochs = [last3([a for _, _, a in r["evals"]]) if "diverged_at_epoch" not in r else 0.0 for r in mine]
        at_time = []
        for r in mine:
            budget = min(o.get("virtual_s", math.inf) for o in by_seed[r["seed"]])
            at_time.append(0.0 if "diverged_at_epoch" in r else last3([a for _, t, a in r["evals"] if t <= budget]))
        ok = [r for r in mine if "diverged_at_epoch" not in r]
        out[arm] = {"equal_epochs": spread(epochs), "equal_time": spread(at_time),
                    "diverged": len(mine) - len(ok),
                    "p99": max((r["p99"] for r in ok), default=None),
                    "slowest_p99": max((r["slowest_p99"] for r in ok), default=None),
                    "max": max((r["max"] for r in ok), default=None),
                    "batches": ok[0]["batches"] if ok else None}
    return out


def spread(values: list[float | None]) -> list[float] | None:
    got = [v for v in values if v is not None]
    return [round(100 * fmean(got), 1), round(100 * min(got), 1), round(100 * max(got), 1)] if got else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--speeds", default="HL8", help="geometric:H, linear:H, a comma list, or an ASP level")
    p.add_argument("--model", default="cnn1d")
    p.add_argument("--global-batch", type=int, default=512)
    p.add_argument("--min-batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.0)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--control-interval", type=int, default=15)
    p.add_argument("--fixed-ms", type=float, default=2.0, help="virtual ms per push on the fastest worker")
    p.add_argument("--sample-ms", type=float, default=0.05, help="virtual ms per sample on the fastest worker")
    p.add_argument("--arms", default="uniform,omnilearn", help=f"from {', '.join(ARMS)}")
    p.add_argument("--json", help="write every run's record here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if min(args.workers, args.epochs, args.seeds, args.global_batch) < 1 or args.lr <= 0:
        raise SystemExit("asp_regimes: --workers, --epochs, --seeds and --global-batch must be at least 1, --lr "
                         "positive")
    try:
        speeds = speeds_of(args.speeds, args.workers)
    except SpeedError as e:
        raise SystemExit(f"asp_regimes: {e}") from None
    if not set(args.arms.split(",")) <= set(ARMS):
        raise SystemExit(f"asp_regimes: --arms {args.arms!r}: choose from {', '.join(ARMS)}")
    splits = workload.load_data(TrainConfig(model=args.model))
    began, results = time.perf_counter(), []
    for seed in range(args.seeds):
        for arm in args.arms.split(","):
            results.append(run_arm(arm, args, speeds, seed, splits))
            r = results[-1]
            last = r["evals"][-1][2] if r["evals"] else float("nan")
            print(f"seed {seed} {arm:9s} " + (f"diverged in epoch {r['diverged_at_epoch']}"
                  if "diverged_at_epoch" in r else f"{len(r['evals'])} evals, last {100 * last:.1f}%, "
                  f"p99 {r['p99']} (slowest {r['slowest_p99']}), batches {r['batches']}"), flush=True)
    table = figures(results)
    print(f"{args.workers} workers at {','.join(f'{s:.3g}' for s in speeds)}, lr {args.lr}, momentum "
          f"{args.momentum}, {args.epochs} epochs, {args.seeds} seeds ({time.perf_counter() - began:.0f} s)")
    for arm, f in table.items():
        print(f"  {arm:9s} equal epochs {f['equal_epochs']} | equal time {f['equal_time']} | diverged "
              f"{f['diverged']} | staleness p99 {f['p99']} (slowest worker {f['slowest_p99']}), max {f['max']}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "speeds": speeds, "figures": table, "runs": results}, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())

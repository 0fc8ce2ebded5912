"""``omnilearn simulate`` flags, and the :class:`~omnilearn.experiments.simulate.model.Scenario` they describe.

Every bad value raises :class:`~omnilearn.config.ConfigError` with one line
naming the flag (the CLI prints ``omnilearn: error: ...`` and exits 2).
"""

from __future__ import annotations

import argparse

import numpy as np

from omnilearn.balance.allocation import InfeasibleBounds, round_shares
from omnilearn.balance.controllers import CONTROLLERS
from omnilearn.config import ConfigError
from omnilearn.emulation.speeds import BSP_LEVELS, SpeedError, paper_schedule, parse_speeds
from omnilearn.experiments.simulate.model import GPU_SPEEDS, Change, Scenario, ring_allreduce_s, with_changes

DEFAULT_MIX = "a100:0.25,v100:0.5,t4:0.25"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``omnilearn simulate`` (also ``python -m omnilearn.experiments.simulate.whatif``)."""
    add = p.add_argument
    add("--workers", type=int, help="simulated workers, 2 to 10,000 (default: from --speeds, else 4)")
    add("--speeds", help=f"relative speeds, a comma list (8,1,1,1) or a level ({', '.join(BSP_LEVELS)}); "
        "default HL8 at 4 workers, else --mix")
    add("--mix", help=f"GPU generations in proportions, e.g. {DEFAULT_MIX} (known: "
        f"{', '.join(f'{k} {v:g}' for k, v in GPU_SPEEDS.items())}: rough relative speeds)")
    add("--sample-ms", type=float, default=0.5, help="compute ms per sample on the fastest worker (default 0.5)")
    add("--fixed-ms", type=float, default=5.0, help="fixed compute ms per step on the fastest worker (default 5); "
        "a worker s times slower takes s times both")
    add("--global-batch", type=int, help="samples per step over all workers (default --local-batch x workers)")
    add("--local-batch", type=int, default=64, help="mean samples per worker when --global-batch is not given (64)")
    add("--min-batch", type=int, default=1, help="smallest per-worker batch (default 1)")
    add("--max-batch", help="memory cap per worker: one number, one per worker, or per GPU name (a100:512,t4:128)")
    add("--noise", type=float, default=0.05, help="per-step multiplicative noise, the sd of 1 + noise N(0,1) (0.05)")
    add("--spikes", help="P[:F]: a share P of worker-steps takes F times longer (default F 3), e.g. 0.02:3")
    add("--change", action="append", default=[], metavar="STEP:WORKERS:FACTOR",
        help="from STEP on the workers (an index or a range 0-9) take FACTOR times as long (2.0: 2x slower); "
        "repeatable")
    add("--schedule", choices=("paper",), help="paper: HL1->2->4->8->8->4->2->1 in equal blocks (4 workers)")
    add("--model-bytes", type=float, default=0.0, help="gradient bytes all-reduced per step (e.g. 4.5e7; default 0)")
    add("--bandwidth-gbps", type=float, default=10.0, help="link bandwidth of the ring all-reduce (default 10)")
    add("--latency-ms", type=float, default=0.0, help="fixed sync ms per step (default 0)")
    add("--overhead-ms", type=float, default=0.0, help="ms per step outside the step (data, control work; default 0)")
    add("--steps", type=int, default=300, help="steps per controller (default 300)")
    add("--control-interval", type=int, default=15, help="steps per control window (default 15)")
    add("--lag", type=int, default=0, help="steps between a decision and the first step it changes, minus one (0)")
    add("--deadband", type=float, default=0.05, help="the loop's deadband on the predicted gain (default 0.05)")
    add("--history", type=int, default=10, help="control windows the loop keeps (default 10)")
    add("--no-checks", action="store_true", help="no mid-interval looks for a speed shift (the runtime has them)")
    add("--from-step", type=int, default=0, help="figures over the steps from this one on (default 0: all)")
    add("--seed", type=int, default=0, help="seed of the scenario's random draws, the same for every controller")
    add("--controllers", default="uniform,static,omnilearn,model", help="comma list from " + ", ".join(CONTROLLERS))
    add("--plot", metavar="OUT.png", help="draw step time vs ideal and a few workers' batches")
    add("--json", metavar="OUT.json", help="write the figures as JSON")
    add("--from-bench", metavar="DIR", help="calibrate on an `omnilearn bench` directory and predict its arms")
    add("--setting", help="with --from-bench: the level to calibrate on and predict "
        "(default: the bench's last of HL2-HL8)")
    add("--seeds", type=int, default=8, help="with --from-bench: simulated repeats per arm (default 8)")
    add("--scenario", choices=("whatif", "churn"), default="whatif",
        help="churn: the loop's churn/follow/decision-time table of `python -m omnilearn.experiments.simulate.churn`")


def parse_controllers(text: str) -> list[str]:
    names = [c.strip().lower() for c in text.split(",") if c.strip()]
    bad = [c for c in names if c not in CONTROLLERS]
    if bad or not names:
        raise ConfigError(f"--controllers {text!r}: unknown controller {bad[0] if bad else '(none)'!r}; "
                          f"choose from {', '.join(CONTROLLERS)}")
    if len(set(names)) != len(names):
        raise ConfigError(f"--controllers {text!r} names a controller twice")
    return names


def parse_mix(text: str, workers: int) -> tuple[np.ndarray, list[str]]:
    """Per worker its speed and GPU name: the mix's kinds in blocks, counts by largest remainder."""
    kinds, shares = [], []
    for part in text.split(","):
        name, _, share = part.strip().partition(":")
        name = name.strip().lower()
        if name not in GPU_SPEEDS:
            raise ConfigError(f"--mix {text!r}: unknown GPU {name!r}; known: {', '.join(GPU_SPEEDS)} (or use --speeds)")
        try:
            value = float(share)
        except ValueError:
            raise ConfigError(f"--mix {text!r}: {part.strip()!r} needs NAME:SHARE, e.g. a100:0.25") from None
        if not value > 0:
            raise ConfigError(f"--mix {text!r}: share {share} of {name} must be positive")
        kinds.append(name)
        shares.append(value)
    counts = round_shares(np.asarray(shares) / sum(shares) * workers, 0, workers, workers)
    names = [k for k, c in zip(kinds, counts) for _ in range(int(c))]
    return np.array([GPU_SPEEDS[k] for k in names]), names


def parse_change(text: str, workers: int) -> Change:
    try:
        step, who, factor = text.split(":")
        first, _, last = who.partition("-")
        change = Change(int(step), int(first), int(last or first), float(factor))
    except ValueError:
        raise ConfigError(f"--change {text!r}: give STEP:WORKERS:FACTOR, e.g. 200:0:2.0 or 200:0-9:1.5") from None
    if change.step < 0 or not 0 <= change.first <= change.last < workers or not change.factor > 0:
        raise ConfigError(f"--change {text!r}: need step >= 0, workers within 0..{workers - 1}, factor > 0")
    return change


def parse_caps(text: str | None, names: list[str] | None, workers: int) -> int | tuple[int, ...] | None:
    if text is None:
        return None
    try:
        if ":" in text:
            caps = {k.strip().lower(): int(v) for k, v in (p.split(":") for p in text.split(","))}
            if names is None or not set(names) <= set(caps):
                raise ConfigError(f"--max-batch {text!r}: per-GPU caps need --mix and a cap for every GPU in it")
            return tuple(caps[k] for k in names)
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise ConfigError(f"--max-batch {text!r}: give a number, one per worker, or NAME:CAP pairs") from None
    if len(values) not in (1, workers):
        raise ConfigError(f"--max-batch {text!r} gives {len(values)} caps for {workers} workers")
    return values[0] if len(values) == 1 else tuple(values)


def worker_speeds(args: argparse.Namespace) -> tuple[np.ndarray, list[str] | None]:
    if args.speeds and args.mix:
        raise ConfigError("--speeds and --mix both given; give one")
    if args.schedule == "paper":
        if args.speeds or args.mix or (args.workers or 4) != 4:
            raise ConfigError("--schedule paper sets the speeds of 4 workers; drop --speeds/--mix/--workers")
        return np.asarray(BSP_LEVELS["HL1"], dtype=float), None
    if args.mix or (args.speeds is None and (args.workers or 4) != 4):
        return parse_mix(args.mix or DEFAULT_MIX, args.workers)
    text = args.speeds or "HL8"
    try:
        n = args.workers or (4 if text.strip().upper() in BSP_LEVELS else len(text.split(",")))
        return np.asarray(parse_speeds(text, n), dtype=float), None
    except SpeedError as e:
        raise ConfigError(f"--speeds: {e}") from None


def scenario_from_args(args: argparse.Namespace) -> Scenario:
    """The :class:`Scenario` the flags describe (see ``omnilearn simulate --help``)."""
    if args.workers is not None and not 2 <= args.workers <= 10_000:
        raise ConfigError(f"--workers {args.workers} must be within 2..10000")
    for flag in ("sample_ms", "bandwidth_gbps", "steps", "control_interval", "local_batch", "history"):
        if not getattr(args, flag) > 0:
            raise ConfigError(f"--{flag.replace('_', '-')} {getattr(args, flag)} must be positive")
    speeds, names = worker_speeds(args)
    n = speeds.size
    slow = speeds.max() / speeds
    base = ()
    if args.schedule == "paper":
        sched = paper_schedule(args.steps, n)
        base = tuple((s, speeds / np.asarray(v, dtype=float)) for s, v in zip(sched.starts, sched.speeds))
    changes = [parse_change(c, n) for c in args.change]
    spike_p, _, spike = (args.spikes or "0").partition(":")
    try:
        spike_p, spike = float(spike_p), float(spike or 3.0)
    except ValueError:
        raise ConfigError(f"--spikes {args.spikes!r}: give P[:F], e.g. 0.02:3") from None
    if min(args.fixed_ms, args.model_bytes, args.latency_ms, args.overhead_ms, args.lag) < 0:
        raise ConfigError("--fixed-ms, --model-bytes, --latency-ms, --overhead-ms and --lag must be >= 0")
    try:
        return Scenario(
            alpha_s=1e-3 * args.fixed_ms * slow, beta_s=1e-3 * args.sample_ms * slow,
            global_batch=args.global_batch or args.local_batch * n, steps=args.steps, declared=tuple(speeds),
            segments=with_changes(n, changes, base), noise=args.noise, spike_p=spike_p, spike=spike,
            sync_s=ring_allreduce_s(n, args.model_bytes, args.bandwidth_gbps, 1e-3 * args.latency_ms),
            gap_s=1e-3 * args.overhead_ms, min_batch=args.min_batch, max_batch=parse_caps(args.max_batch, names, n),
            interval=args.control_interval, lag=args.lag, deadband=args.deadband, history=args.history,
            checks=not args.no_checks, seed=args.seed)
    except InfeasibleBounds as e:
        raise ConfigError(str(e)) from None


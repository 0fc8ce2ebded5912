"""OmniLearn's per-step cost over plain FSDP2 (``fully_shard``) with nothing to balance: both loops, interleaved.

The FSDP2 twin of ``tools/hl1_breakdown.py`` (whose loop, parts and profile it uses): a tiny GPT (the zoo's,
``--layers`` blocks of ``--width``, sequences of ``--seq`` tokens over a vocabulary of ``--vocab``, synthetic
tokens) is sharded the usual way (``fully_shard`` per block, then the root) once per loop, in the same processes:

- plain FSDP2: a ``DataLoader`` over a ``DistributedSampler``, forward, loss, backward (FSDP's all-gathers and
  reduce-scatters inside), ``step`` and ``zero_grad``;
- ``+ sharded.py``: the same with only :func:`omnilearn.bsp.sharded.prepare` applied (weighted reduce-scatters,
  timed collectives and waits), fed by a stub as cheap as a session (a 0-dim float64 weight, no emulated delay,
  so the process CPU time is not read): what the FSDP2 adapter alone costs;
- ``+ CPU clock`` (``--cpu-clock``): the same, reading the process CPU time around every collective and wait
  (``prepare`` without ``cpu_time``), as when the delay emulator stretches this rank;
- OmniLearn (not with ``--no-session``): the sharded model through ``ol.wrap_model``, ``ol.data_loader`` and
  ``ol.step``;

trained in alternating blocks of ``--steps`` steps. It prints each part in microseconds per step (mean over ranks,
median over blocks), and for each loop against plain FSDP2: each round's ratio of wall times, their median (with
its 95% interval, the rounds resampled), the median extra microseconds per step and the median extra in
``fwd+bwd`` (where the adapter's cost falls).
``--profile N``: rank 0 runs N more steps of the last loop under cProfile and prints the N functions with the
most own time.

A benchmark, not a test: run it alone on the machine (one core per rank).

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 tools/fsdp2_breakdown.py --blocks 8
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler

import omnilearn
from hl1_breakdown import Loop, check_args, forever, profile, spread  # tools/ is this script's directory
from omnilearn.bsp import sharded
from omnilearn.experiments.zoo.gpt import GPT, GPTConfig

SEED = 0
PLAIN, PREPARED, CPU_CLOCK = "plain FSDP2", "+ sharded.py", "+ CPU clock"


class Tokens(torch.utils.data.Dataset):
    """``n`` random sequences of ``seq`` tokens; the target is the next token."""

    def __init__(self, n: int, seq: int, vocab: int) -> None:
        tokens = torch.randint(vocab, (n, seq + 1), generator=torch.Generator().manual_seed(SEED))
        self.x, self.y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def sharded_gpt(args) -> torch.nn.Module:
    """The zoo's GPT, the same weights on every rank, sharded per block then at the root."""
    torch.manual_seed(SEED)
    model = GPT(GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                          n_embd=args.width))
    for block in model.blocks:
        fully_shard(block)
    return fully_shard(model)


def plain_loop(args, data: Tokens) -> Loop:
    world, rank = dist.get_world_size(), dist.get_rank()
    model = sharded_gpt(args)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sampler = DistributedSampler(data, world, rank, shuffle=True, seed=SEED, drop_last=True)
    loader = DataLoader(data, batch_size=args.global_batch // world, sampler=sampler, drop_last=True)
    return Loop(model, opt, forever(loader, sampler.set_epoch), torch.device("cpu"))


class Stub:
    """What :func:`omnilearn.bsp.sharded.prepare` needs from a session, as cheap as a session's own: this rank's
    weight (a 0-dim float64 tensor, as the session's after a decision), the delay emulator at native speed, the
    blocked time summed."""

    def __init__(self, world: int) -> None:
        self.weight, self.wall_s, self.cpu_s = torch.tensor(1.0 / world, dtype=torch.float64), 0.0, 0.0
        self.slowdown = 1.0

    def before(self) -> float:
        return 0.0

    def blocked(self, wall_s: float, cpu_s: float = 0.0) -> None:
        self.wall_s += wall_s
        self.cpu_s += cpu_s

    def stall(self, start, end) -> None:
        pass

    def cpu_time(self) -> bool:
        return self.slowdown > 1.0


def prepared_loop(args, data: Tokens, cpu_clock: bool) -> Loop:
    """Plain FSDP2 with only :func:`omnilearn.bsp.sharded.prepare` added (weighted, timed collectives): its cost.
    ``cpu_clock``: the process CPU time read around every collective and wait, as when no ``cpu_time`` is given."""
    loop = plain_loop(args, data)
    stub = Stub(dist.get_world_size())
    sharded.prepare(loop.model, weight=lambda: stub.weight, before=stub.before, blocked=stub.blocked,
                    stall=stub.stall, device=torch.device("cpu"), cpu_time=None if cpu_clock else stub.cpu_time)
    return loop


def omni_loop(args, data: Tokens, total_steps: int):
    ol = omnilearn.setup(global_batch=args.global_batch, controller="uniform", device="cpu", handle_signals=False,
                         total_steps=total_steps)
    model = ol.wrap_model(sharded_gpt(args))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = ol.data_loader(data)
    return ol, Loop(model, opt, forever(loader, loader.set_epoch), ol.device, after=ol.step)


def measure(loops: dict[str, Loop], blocks: int, steps: int):
    """Interleaved blocks: per loop, each block's wall time per step and its parts (mean over ranks) per step."""
    walls: dict[str, list[float]] = defaultdict(list)
    parts: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for _ in range(blocks):
        for name, loop in loops.items():
            wall, mine = loop.block(steps)
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)
            walls[name].append(wall / steps)
            for part in mine:
                parts[name][part].append(statistics.fmean(r[part] for r in every) / steps)
    return walls, parts


def compare(name: str, walls, parts) -> None:
    """Loop ``name`` against plain FSDP2, pair by pair: wall ratios, extra us per step, and the fwd+bwd part's."""
    plain, other = walls[PLAIN], walls[name]
    ratios = [o / p for p, o in zip(plain, other)]
    extra = [(o - p) * 1e6 for p, o in zip(plain, other)]
    inside = [(o - p) * 1e6 for p, o in zip(parts[PLAIN]["fwd+bwd"], parts[name]["fwd+bwd"])]
    print(f"{name} / {PLAIN} per pair: " + ", ".join(f"{r:.3f}" for r in ratios))
    low, high = spread(ratios)
    print(f"  median ratio {statistics.median(ratios):.3f} (95% interval {low:.3f}-{high:.3f}; min {min(ratios):.3f}, "
          f"max {max(ratios):.3f}); median "
          f"extra {statistics.median(extra):+.0f} us per step, of which fwd+bwd {statistics.median(inside):+.0f} us "
          f"({statistics.median(inside) / (statistics.median(plain) * 1e6):+.1%} of plain's step)")


def report(args, walls, parts) -> None:
    print(f"{dist.get_world_size()} ranks on cpu (gloo), GPT {args.layers}x{args.width} seq {args.seq} vocab "
          f"{args.vocab}, global batch {args.global_batch}: {args.blocks} x {args.steps} steps per loop, interleaved; "
          "us per step (parts: mean over ranks, median over blocks)")
    for name, wall in walls.items():
        print(f"{name:13s} wall {statistics.median(wall) * 1e6:7.0f} | "
              + " | ".join(f"{p} {statistics.median(v) * 1e6:6.0f}" for p, v in parts[name].items()))
    for name in walls:
        if name != PLAIN:
            compare(name, walls, parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=8, help="rounds of blocks (one per loop), interleaved")
    ap.add_argument("--steps", type=int, default=60, help="steps per block")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--cpu-clock", action="store_true",
                    help="also plain FSDP2 + sharded.prepare reading the process CPU clock at every collective and "
                         "wait (prepare without cpu_time, as before issue 33)")
    ap.add_argument("--no-session", action="store_true",
                    help="only plain FSDP2 and plain FSDP2 + sharded.prepare (no OmniLearn session)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="then N steps of the last loop under cProfile on rank 0: the N functions with the most own "
                         "time")
    args = ap.parse_args()
    check_args(ap, args, ("blocks", "steps", "layers", "heads", "width", "seq", "vocab", "global_batch"), ("profile",))
    if args.width % args.heads:
        ap.error(f"--width {args.width} is not a multiple of --heads {args.heads}: give a width the heads divide")
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    data = Tokens(64 * args.global_batch, args.seq, args.vocab)
    loops = {PLAIN: plain_loop(args, data), PREPARED: prepared_loop(args, data, cpu_clock=False)}
    if args.cpu_clock:
        loops[CPU_CLOCK] = prepared_loop(args, data, cpu_clock=True)
    ol = None
    if not args.no_session:
        ol, loops["OmniLearn"] = omni_loop(args, data, (args.blocks + 1) * args.steps + args.profile + 10)
    for loop in loops.values():  # warm-up of each, unmeasured
        loop.block(args.steps // 2)
    walls, parts = measure(loops, args.blocks, args.steps)
    table = profile(list(loops.values())[-1], args.profile, args.profile) if args.profile else ""
    if ol is not None:
        ol.release()
    if dist.get_rank() == 0:
        report(args, walls, parts)
        print(table)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

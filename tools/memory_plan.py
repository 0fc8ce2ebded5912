"""Memory as well as speed (issue 52), counted: the bytes a sharded GPT's step holds per rank, the largest model
each way of training fits in declared memories, and the three loops side by side at one width.

The zoo's GPT (``--layers`` blocks of each width in ``--widths``, 4 heads, sequences of ``--seq`` tokens over a
vocabulary of ``--vocab``, synthetic tokens; float32, AdamW, cross-entropy on the next token) is sharded the usual
way (``fully_shard`` per block, then the root), as in ``tools/fsdp2_breakdown.py``. On every rank:

1. bytes, counted with :mod:`omnilearn.bsp.membytes` after one plain step of ``b = global batch / ranks``
   samples: parameters (the local shard), gradients, optimizer state, the largest unsharded block, and the
   activations autograd saved (``SavedBytes``): per sample, the slope between steps of ``b`` and ``b/2``, and
   the intercept (saved bytes that do not grow with the batch);
2. with those bytes and ``--memory`` (each rank's, all with ``memplan.MARGIN`` kept free): the largest width that
   trains (a) as plain FSDP2 (``b`` samples on every rank), (b) with OmniLearn's caps set by hand
   (``max_batch=[...]`` from the counted bytes; accumulation where the caps do not hold the global batch) and
   (c) with OmniLearn's memory plan (``memory=[...]``: ``memplan.cap`` of what its first step counts);
3. at ``--common`` (default: the largest width all three train) the three loops, one fresh ``fully_shard`` each,
   in alternating rounds of ``--steps`` timed steps (after one untimed): samples/s (median over rounds), and per
   rank the share it ran at the end and the bytes it held then (counted as in 1).

Counted bytes, not measured memory: on CPU nothing enforces ``--memory``. A tool, not a test; timings mean
something only alone on the machine (one core per rank).

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 tools/memory_plan.py --memory 48MiB,192MiB
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import statistics
import sys
import time
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler

import omnilearn
from fsdp2_breakdown import Tokens  # tools/ is this script's directory
from hl1_breakdown import forever
from omnilearn.balance import memplan
from omnilearn.bsp import membytes
from omnilearn.experiments.zoo.gpt import GPT, GPTConfig

SEED, HEADS = 0, 4
PLAIN, CAPS, PLAN = "(a) plain FSDP2", "(b) max_batch caps", "(c) memory plan"


def fail(message: str) -> None:
    """Bad input: one line (rank 0 only; the others wait a moment: torchrun ends the rest at the first exit)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"memory_plan.py: error: {message}", file=sys.stderr, flush=True)
    else:
        time.sleep(1.0)
    sys.exit(2)


def sharded_gpt(args: argparse.Namespace, width: int) -> nn.Module:
    """The zoo's GPT, the same weights on every rank, sharded per block then at the root."""
    torch.manual_seed(SEED)
    model = GPT(GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=HEADS,
                          n_embd=width))
    for block in model.blocks:
        fully_shard(block)
    return fully_shard(model)


def step(model: nn.Module, opt: torch.optim.Optimizer, parts: list, backward: Callable[[torch.Tensor], None],
         after: Callable[[], None] = lambda: None, count: bool = False) -> dict[str, float] | None:
    """One step over ``parts`` (micro-batches): zero_grad first (the gradients live through the step), forward,
    backward, optimizer, ``after``. ``count``: what the step held, counted once the optimizer stepped."""
    opt.zero_grad()
    saved = membytes.SavedBytes() if count else contextlib.nullcontext()
    with saved:
        for x, y in parts:
            backward(F.cross_entropy(model(x).flatten(0, 1), y.flatten()))
    opt.step()
    held = None
    if count:
        params = membytes.tensor_bytes(model.parameters())
        grads = membytes.tensor_bytes(p.grad for p in model.parameters() if p.grad is not None)
        state = membytes.state_bytes(model, [opt])
        held = dict(params=params, grads=grads, opt=state - params - grads, state=state,
                    block=membytes.block_bytes(model), saved=saved.peak, samples=sum(len(x) for x, _ in parts))
    after()
    return held


def count_width(args: argparse.Namespace, width: int, data: Tokens) -> dict[str, float]:
    """Part 1 on this rank: a step of b samples and one of b/2, counted."""
    b = args.global_batch // dist.get_world_size()
    half, start = b // 2, dist.get_rank() * b
    x, y = data.x[start:start + b].clone(), data.y[start:start + b].clone()  # own storage, as a loader's batch
    model = sharded_gpt(args, width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    full = step(model, opt, [(x, y)], torch.Tensor.backward, count=True)
    low = step(model, opt, [(x[:half].clone(), y[:half].clone())], torch.Tensor.backward, count=True)
    slope = (full["saved"] - low["saved"]) / (b - half)
    row = dict(full, width=width, total=sum(p.numel() for p in model.parameters()), per_sample=slope,
               intercept=full["saved"] - slope * b, first=full["saved"] / b)
    del model, opt
    gc.collect()
    return row


def plan(rows: list[dict], memory: list[int], global_batch: int) -> dict[str, Any]:
    """Part 2 for one width (``rows``: one per rank): does each setting train, and with which caps."""
    room = [(1.0 - memplan.MARGIN) * m for m in memory]
    share = global_batch // len(memory)
    plain = all(r["state"] + r["block"] + r["intercept"] + r["per_sample"] * share <= room[i]
                for i, r in enumerate(rows))
    caps_b = [max(0, math.floor((room[i] - r["state"] - r["block"] - r["intercept"]) / max(r["per_sample"], 1.0)))
              for i, r in enumerate(rows)]
    try:
        caps_c: list[int] | None = [memplan.cap(memory[i], memplan.Needs(r["state"], r["block"], r["first"]), i)
                                    for i, r in enumerate(rows)]
    except memplan.PlanError:
        caps_c = None

    def steps(caps: list[int] | None) -> int | None:  # accumulation steps K the caps need (None: cannot train)
        return None if not caps or min(caps) < 1 else math.ceil(global_batch / sum(caps))
    return {PLAIN: plain, "caps_b": caps_b, "caps_c": caps_c, CAPS: steps(caps_b), PLAN: steps(caps_c)}


class Loop:
    """One way of training at the common width: its sharded model, AdamW, batches, and the session if any."""

    def __init__(self, args: argparse.Namespace, width: int, data: Tokens, **settings: Any) -> None:
        self.ol = omnilearn.setup(global_batch=args.global_batch, device="cpu", handle_signals=False,
                                  control_interval=3, quiet=True, **settings) if settings else None
        self.model = sharded_gpt(args, width)
        if self.ol is not None:
            self.model = self.ol.wrap_model(self.model)
            loader = self.ol.data_loader(data)
            self.batches: Iterator = forever(loader, loader.set_epoch)
        else:
            world, rank = dist.get_world_size(), dist.get_rank()
            sampler = DistributedSampler(data, world, rank, shuffle=True, seed=SEED, drop_last=True)
            self.batches = forever(DataLoader(data, batch_size=args.global_batch // world, sampler=sampler,
                                              drop_last=True), sampler.set_epoch)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)

    def step(self, count: bool = False) -> dict[str, float] | None:
        batch = next(self.batches)
        if self.ol is None:
            return step(self.model, self.opt, [batch], torch.Tensor.backward, count=count)
        return step(self.model, self.opt, self.ol.micro_batches(batch), self.ol.backward, self.ol.step, count)


def gathered(mine: Any) -> list:
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every


def mib(size: float) -> str:
    return f"{size / 2**20:.2f}"


def part1(args: argparse.Namespace, table: dict[int, list[dict]]) -> None:
    share = args.global_batch // len(args.memory)
    print(f"Part 1: bytes per rank, counted (membytes) after one plain FSDP2 step of {share} samples per rank; GPT "
          f"{args.layers} layers x width, {HEADS} heads, seq {args.seq}, vocab {args.vocab}, float32, AdamW; "
          "activations/sample: slope between b and b/2 samples")
    print(f"{'width':>5} {'rank':>4} {'params':>10} {'param B':>11} {'grad B':>11} {'optim B':>11} {'block B':>11} "
          f"{'act B/sample':>12} {'intercept B':>11}")
    for width, rows in table.items():
        for rank, r in enumerate(rows):
            print(f"{width:5d} {rank:4d} {r['total']:10d} {r['params']:11d} {r['grads']:11d} {r['opt']:11d} "
                  f"{r['block']:11d} {r['per_sample']:12.0f} {r['intercept']:11.0f}")


def part2(args: argparse.Namespace, table: dict[int, list[dict]], plans: dict[int, dict]) -> None:
    said = ", ".join(f"rank {i} {memplan.human(m)}" for i, m in enumerate(args.memory))
    print(f"\nPart 2: the largest width each setting trains with global batch {args.global_batch} in {said}; all three "
          f"keep memplan.MARGIN = {memplan.MARGIN:.0%} of each rank's memory free (compared alike). (b): caps from the "
          "counted slope and intercept; (c): memplan.cap as the product's first step computes it (the whole peak "
          "over the first step's samples)")
    print(f"{'width':>5} {'params':>10} {'state MiB/rank':>16} {PLAIN:>16} {CAPS + ' (K)':>24} {PLAN + ' (K)':>24}")
    for width, p in plans.items():
        rows = table[width]
        state = "/".join(mib(r["state"]) for r in rows)
        b = f"{p['caps_b']} K={p[CAPS]}" if p[CAPS] else f"{p['caps_b']} no"
        c = f"{p['caps_c']} K={p[PLAN]}" if p[PLAN] else "PlanError"
        print(f"{width:5d} {rows[0]['total']:10d} {state:>16} {'fits' if p[PLAIN] else 'no':>16} {b:>24} {c:>24}")
    for name in (PLAIN, CAPS, PLAN):
        ok = [w for w, p in plans.items() if p[name]]
        best = (f"width {max(ok)} ({table[max(ok)][0]['total']} parameters"
                + (f", accumulation_steps={plans[max(ok)][name]}" if name != PLAIN and plans[max(ok)][name] > 1
                   else "") + ")") if ok else "no width of the ladder"
        print(f"largest trainable, {name}: {best}")
    same = [w for w, p in plans.items() if p["caps_b"] == p["caps_c"]]
    print(f"(b) and (c) give the same caps at widths {same or 'none'} of {list(plans)}: on torch {torch.__version__} "
          "FSDP2 splits the state evenly (no uneven placement), so the memory plan can only set each rank's batch "
          "cap, which is what a hand-set max_batch does; where they differ, it is because (c) divides the first "
          "step's whole peak (the intercept too) by its samples")


def part3(args: argparse.Namespace, table: dict[int, list[dict]], plans: dict[int, dict], width: int,
          data: Tokens) -> None:
    p = plans[width]
    extra = {name: {"accumulation_steps": p[name]} if p[name] > 1 else {} for name in (CAPS, PLAN)}
    loops = {PLAIN: Loop(args, width, data),
             CAPS: Loop(args, width, data, max_batch=list(p["caps_b"]), **extra[CAPS]),
             PLAN: Loop(args, width, data, memory=list(args.memory), **extra[PLAN])}
    walls: dict[str, list[float]] = {name: [] for name in loops}
    for _ in range(args.rounds):
        for name, loop in loops.items():
            loop.step()  # warm-up, untimed
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                loop.step()
            dist.barrier()
            walls[name].append(time.perf_counter() - start)
    held = {name: gathered(loop.step(count=True)) for name, loop in loops.items()}
    planned = {name: loop.ol.batches if loop.ol is not None else None for name, loop in loops.items()}
    product = gathered(loops[PLAN].ol.max_batch)  # the cap the session counted in its first step
    for loop in loops.values():
        if loop.ol is not None:
            loop.ol.finish()
    if dist.get_rank() != 0:
        return
    print(f"\nPart 3: width {width} ({table[width][0]['total']} parameters), global batch {args.global_batch}: "
          f"{args.rounds} rounds of {args.steps} timed steps of each loop, interleaved in the same processes; caps "
          f"(b) {p['caps_b']}, (c) {p['caps_c']} (the session's own count: {product}); bytes held at the last step "
          "(state + block + peak saved)")
    rate = {name: statistics.median(args.global_batch * args.steps / w for w in wall) for name, wall in walls.items()}
    for name, rows in held.items():
        shares = [r["samples"] for r in rows]
        bytes_held = ", ".join(f"rank {i} {mib(r['state'] + r['block'] + r['saved'])} MiB of "
                               f"{memplan.human(args.memory[i])}" for i, r in enumerate(rows))
        plan_next = f" (next: {list(planned[name])})" if planned[name] is not None else ""
        print(f"{name:20s} {rate[name]:8.1f} samples/s | shares {shares}{plan_next} | held {bytes_held}")
    for name in (CAPS, PLAN):
        print(f"{name} / {PLAIN}: {rate[name] / rate[PLAIN]:.3f} samples/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--memory", required=True, help="each rank's memory, e.g. 48MiB,192MiB (one, or one per rank)")
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--widths", default="64,96,128,192,256,320,384,448,512", help=f"n_embd ladder (x{HEADS} heads)")
    ap.add_argument("--common", type=int, help="part 3's width (default: the largest all three settings train)")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per round and loop")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        memory = memplan.parse_memory(args.memory)
        if memory == memplan.AUTO:
            fail(f"--memory {args.memory}: auto measures a CUDA device; this tool runs on CPU: declare the bytes")
        args.memory = [memplan.rank_memory(memory, r, world) for r in range(world)]
    except memplan.PlanError as e:
        fail(str(e))
    try:
        args.widths = sorted({int(w) for w in args.widths.split(",")})
    except ValueError:
        fail(f"--widths {args.widths} must be integers separated by commas, e.g. 64,128")
    for name in ("global_batch", "seq", "vocab", "layers", "steps", "rounds"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} {getattr(args, name)} must be positive")
    if any(w < 1 or w % HEADS for w in args.widths):
        fail(f"--widths {','.join(map(str, args.widths))}: each must be a positive multiple of {HEADS} (the heads)")
    if args.global_batch % world or args.global_batch // world < 2:
        fail(f"--global-batch {args.global_batch} must split evenly into at least 2 samples per rank ({world} ranks)")
    if args.common is not None and args.common not in args.widths:
        fail(f"--common {args.common} must be one of --widths (its bytes are counted in part 1)")
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    data = Tokens(64 * args.global_batch, args.seq, args.vocab)
    table = {w: gathered(count_width(args, w, data)) for w in args.widths}
    plans = {w: plan(rows, args.memory, args.global_batch) for w, rows in table.items()}
    if dist.get_rank() == 0:
        part1(args, table)
        part2(args, table, plans)
    every = [w for w, p in plans.items() if p[PLAIN] and p[CAPS] and p[PLAN]]
    width = args.common if args.common is not None else max(every, default=None)
    if width is None or width not in every:
        if dist.get_rank() == 0:
            print(f"\nPart 3 skipped: {'no width of the ladder' if width is None else f'width {width}'} trains in "
                  f"all three settings")
    else:
        sys.stdout.flush()
        part3(args, table, plans, width, data)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Small collectives the trainer needs besides DDP's gradient all-reduce.

One ``all_gather`` per control interval carries every worker's per-step
measurements to every rank (the controller runs identically everywhere, and
rank 0 writes them out), so there is no extra message per step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from omnilearn.distributed.group import DistContext


def gather_rows(ctx: DistContext, rows: list[list[float]], width: int) -> list[list[list[float]]]:
    """All-gather a ``[k, width]`` table from every rank (same ``k`` everywhere)."""
    if not ctx.grouped:
        return [[list(map(float, r)) for r in rows]]
    local = torch.tensor(rows, dtype=torch.float64, device=ctx.device).reshape(len(rows), width)
    parts = [torch.empty_like(local) for _ in range(ctx.world_size)]
    dist.all_gather(parts, local)
    return [p.cpu().tolist() for p in parts]


def sum_across(ctx: DistContext, values: list[float]) -> list[float]:
    if not ctx.grouped:
        return [float(v) for v in values]
    t = torch.tensor(values, dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.cpu().tolist()


def average_buffers(ctx: DistContext, buffers: list[torch.Tensor], weight: float) -> None:
    """In place: every floating buffer becomes ``sum_i weight_i * buffer_i`` (one all-reduce for all)."""
    floats = [b for b in buffers if b.is_floating_point()]
    if not ctx.grouped or not floats:
        return
    flat = torch.cat([b.detach().reshape(-1).to(torch.float64) for b in floats]) * weight
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    for b, part in zip(floats, flat.split([b.numel() for b in floats])):
        b.copy_(part.view_as(b))


def same_everywhere(ctx: DistContext, fingerprint: int) -> list[int]:
    """Ranks whose ``fingerprint`` differs from rank 0's (empty when all agree)."""
    if not ctx.grouped:
        return []
    mine = torch.tensor([fingerprint], dtype=torch.int64, device=ctx.device)
    parts = [torch.empty_like(mine) for _ in range(ctx.world_size)]
    dist.all_gather(parts, mine)
    values = [int(p.item()) for p in parts]
    return [r for r, v in enumerate(values) if v != values[0]]

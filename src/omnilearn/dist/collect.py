"""Small collectives the trainer needs besides DDP's gradient all-reduce.

One ``all_gather`` per control interval carries every worker's per-step
measurements to every rank (the controller runs identically everywhere, and
rank 0 writes them out), so there is no extra message per step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from omnilearn.dist.group import DistContext


def gather_rows(ctx: DistContext, rows: list[list[float]], width: int) -> list[list[list[float]]]:
    """All-gather a ``[k, width]`` table from every rank (same ``k`` everywhere)."""
    local = torch.tensor(rows, dtype=torch.float64, device=ctx.device).reshape(len(rows), width)
    parts = [torch.empty_like(local) for _ in range(ctx.world_size)]
    dist.all_gather(parts, local)
    return [p.cpu().tolist() for p in parts]


def sum_across(ctx: DistContext, values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.cpu().tolist()


def same_everywhere(ctx: DistContext, fingerprint: int) -> list[int]:
    """Ranks whose ``fingerprint`` differs from rank 0's (empty when all agree)."""
    mine = torch.tensor([fingerprint], dtype=torch.int64, device=ctx.device)
    parts = [torch.empty_like(mine) for _ in range(ctx.world_size)]
    dist.all_gather(parts, mine)
    values = [int(p.item()) for p in parts]
    return [r for r, v in enumerate(values) if v != values[0]]

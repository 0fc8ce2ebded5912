"""Small collectives the session needs besides DDP's gradient all-reduce.

Per window: one all-gather of a row per rank (every rank runs the same
control loop on the same table, and rank 0 totals the window's step rows the
row carries; :class:`RowGathering` starts it and reads it later, so a meeting
overlaps the next step). :func:`gather_to_main` brings one small table per rank to
rank 0 (the summary's per-worker sums, once at the end). One process alone
(no group) gets its own data back.

Checkpoint bytes travel by :func:`broadcast_chunks`: host memory, pieces of
at most :data:`CHUNK_BYTES`, over a group that carries CPU tensors
(:func:`~omnilearn.distributed.group.cpu_group`), received in place into one
buffer: no device memory and no second copy on any rank.

Run: ``python -m pytest -q tests/dist/test_api.py tests/dist/test_checkpoint_load.py``
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist

from omnilearn.distributed.group import DistContext

CHUNK_BYTES = 16 * 2**20  # one piece of a broadcast_chunks
# One all-gather into one output tensor: torch 2.13 names it all_gather_single (the old name warns), 2.11 not yet.
_GATHER_INTO = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class RowGathering:
    """An all-gather of one row per rank in flight; :meth:`wait` gives every rank's row, in rank order."""

    def __init__(self, ctx: DistContext, row: Sequence[float], group=None) -> None:
        self.work, self.rows = None, None
        world = 1 if not ctx.grouped else ctx.world_size if group is None else dist.get_world_size(group)
        if world == 1:  # one process alone (or a group of one): its own row, at once
            self.full = np.asarray(row, dtype=np.float64).reshape(1, -1)
        else:
            mine = torch.as_tensor(np.asarray(row, dtype=np.float64), device=ctx.device)  # an array: no copy on CPU
            self.out = torch.empty(world * len(mine), dtype=torch.float64, device=ctx.device)  # flat: gloo's need
            self.shape = (world, len(mine))
            self.work = _GATHER_INTO(self.out, mine, group=group, async_op=True)  # one buffer: no stack

    def wait(self) -> list[list[float]]:
        if self.rows is None:
            self.rows = self.array().tolist()
        return self.rows

    def array(self) -> np.ndarray:
        """Every rank's row, in rank order, as one ``[world, len(row)]`` float64 array (no Python float each)."""
        if self.work is not None:
            work, self.work = self.work, None
            work.wait()
            self.full = self.out.view(self.shape).cpu().numpy()
        return self.full


def all_gather_row(ctx: DistContext, row: Sequence[float], group=None) -> list[list[float]]:
    """Every rank's ``row`` (same length everywhere), in rank order."""
    return RowGathering(ctx, row, group).wait()


def gather_to_main(ctx: DistContext, rows: list[list[float]], width: int) -> list[list[list[float]]] | None:
    """Rank 0 gets every rank's ``[k, width]`` table (same ``k`` everywhere); other ranks get None."""
    if not ctx.grouped:
        return [[[float(v) for v in r] for r in rows]]
    local = torch.tensor(rows, dtype=torch.float64, device=ctx.device).reshape(len(rows), width)
    parts = [torch.empty_like(local) for _ in range(ctx.world_size)] if ctx.is_main else None
    dist.gather(local, parts, dst=0)
    return [p.cpu().tolist() for p in parts] if parts is not None else None


def share_path(ctx: DistContext, path: Path | None) -> Path | None:
    """Rank 0's ``path`` (or None) on every rank: one broadcast of its bytes (a length, then the bytes)."""
    if not ctx.grouped:
        return path
    data = str(path).encode("utf-8") if ctx.is_main and path is not None else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=ctx.device)
    dist.broadcast(size, src=0)
    if not int(size.item()):
        return None
    buf = torch.tensor(list(data), dtype=torch.uint8, device=ctx.device) if ctx.is_main \
        else torch.empty(int(size.item()), dtype=torch.uint8, device=ctx.device)
    dist.broadcast(buf, src=0)
    return Path(bytes(buf.cpu().tolist()).decode("utf-8"))


def sum_across(ctx: DistContext, values: list[float], group=None) -> list[float]:
    """Element-wise sum over the ranks of ``group`` (default: all)."""
    if not ctx.grouped:
        return [float(v) for v in values]
    t = torch.tensor(values, dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t.cpu().tolist()


def sum_tensor(ctx: DistContext, t: torch.Tensor, group=None) -> torch.Tensor:
    """``t`` summed in place over the ranks of ``group`` (default: all), on its device: no host sync."""
    if ctx.grouped:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def average_buffers(ctx: DistContext, buffers: list[torch.Tensor], weight: float) -> None:
    """In place: every floating buffer becomes ``sum_i weight_i * buffer_i`` (one all-reduce for all)."""
    floats = [b for b in buffers if b.is_floating_point()]
    if not ctx.grouped or not floats:
        return
    flat = torch.cat([b.detach().reshape(-1).to(torch.float64) for b in floats]) * weight
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    for b, part in zip(floats, flat.split([b.numel() for b in floats])):
        b.copy_(part.view_as(b))


def disagreements(ctx: DistContext, values: Sequence[int]) -> dict[int, list[int]]:
    """Per rank whose ``values`` differ from rank 0's: the positions that differ (empty when all agree).

    Every rank must pass the same number of values.
    """
    if not ctx.grouped:
        return {}
    mine = torch.tensor([int(v) for v in values], dtype=torch.int64, device=ctx.device)
    parts = [torch.empty_like(mine) for _ in range(ctx.world_size)]
    dist.all_gather(parts, mine)
    table = torch.stack(parts).cpu()
    return {r: [i for i in range(len(values)) if table[r, i] != table[0, i]]
            for r in range(1, ctx.world_size) if not torch.equal(table[r], table[0])}


def _sizes(ctx: DistContext, size: int) -> list[int]:
    mine = torch.tensor([size], dtype=torch.int64, device=ctx.device)
    parts = [torch.empty_like(mine) for _ in range(ctx.world_size)]
    dist.all_gather(parts, mine)
    return [int(p.item()) for p in parts]


def gather_bytes(ctx: DistContext, data: bytes) -> list[bytes] | None:
    """Rank 0 gets every rank's ``data`` (any lengths), in rank order; other ranks get None.

    Raw bytes, not pickled objects: the caller decides how they are read
    (checkpoint parts are ``torch.save`` output, read back with ``weights_only=True``).
    """
    if not ctx.grouped:
        return [data]
    sizes = _sizes(ctx, len(data))
    local = torch.zeros(max(sizes), dtype=torch.uint8, device=ctx.device)
    local[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(ctx.device) if data else local[:0]
    parts = [torch.empty_like(local) for _ in range(ctx.world_size)] if ctx.is_main else None
    dist.gather(local, parts, dst=0)
    return [p[:n].cpu().numpy().tobytes() for p, n in zip(parts, sizes)] if parts is not None else None


def broadcast_bytes(ctx: DistContext, data: bytes | None) -> bytes:
    """Rank 0's ``data`` on every rank (``None`` on rank 0 sends empty bytes); others pass anything."""
    if not ctx.grouped:
        return data or b""
    size = torch.tensor([len(data or b"") if ctx.is_main else 0], dtype=torch.int64, device=ctx.device)
    dist.broadcast(size, src=0)
    n = int(size.item())
    buf = torch.empty(n, dtype=torch.uint8, device=ctx.device)
    if ctx.is_main and n:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    if n:
        dist.broadcast(buf, src=0)
    return buf.cpu().numpy().tobytes() if not ctx.is_main else (data or b"")


def broadcast_chunks(ctx: DistContext, data: bytearray | None, group=None) -> bytearray:
    """Rank 0's ``data`` on every rank (others pass None), sent as CPU tensors of at most :data:`CHUNK_BYTES`.

    ``group`` must carry CPU tensors (:func:`~omnilearn.distributed.group.cpu_group`). Rank 0's buffer is
    sent as it is (views of it); the others receive into one ``bytearray`` of its size, piece by piece.
    """
    if not ctx.grouped:
        return data if data is not None else bytearray()
    size = torch.tensor([len(data) if ctx.is_main and data is not None else 0], dtype=torch.int64)
    dist.broadcast(size, src=0, group=group)
    buf = (data if data is not None else bytearray()) if ctx.is_main else bytearray(int(size.item()))
    if buf:
        view = torch.frombuffer(buf, dtype=torch.uint8)
        for start in range(0, len(buf), CHUNK_BYTES):
            dist.broadcast(view[start : start + CHUNK_BYTES], src=0, group=group)
    return buf

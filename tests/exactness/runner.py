"""The cell runner of the exactness matrix: one launch per world size runs every cell of it, one session each.

:func:`launch` starts the ranks (``tests/ranks.py``: the project's
preloaded fork server) and reads back one JSON line per cell and rank:
``{"id", "rank", "rel"}`` (the relative error to the one-process reference)
or ``{"id", "rank", "raised"}`` (the exception, type and message). A cell
that raises closes its session (``finish()``, else ``release()``) and the
ranks go on to the next cell. After each cell one ``all_gather_object``
brings every rank's cell id and indices (or error): a rank out of step ends
the launch; an error on some ranks only is reported on every rank.

See :mod:`exactness.matrix` for the table.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import omnilearn
from exactness.matrix import GLOBAL_BATCH, GRAD_SCALE, LR, PATTERNS, STEPS, WRAPS, Cell, loss_and_count
from exactness.models import LOSSES, Data, Net
from ranks import max_relative, start_ranks

COLLECTIVE_TIMEOUT_S = 60  # a rank left waiting in a collective (a cell failed on one rank only) ends by then


def build(ol, cell: Cell) -> tuple[nn.Module, Net]:
    """The wrapped model (as the cell's wrapping asks) and the raw module inside it."""
    wrap = WRAPS[cell.wrap]
    dtype = torch.float32 if PATTERNS[cell.pattern].autocast else torch.float64
    net = Net(cell.shape, LOSSES[cell.loss].criterion, dtype, wrap.reentrant)
    if wrap.how == "compile_outer":
        return torch.compile(ol.wrap_model(net), backend="aot_eager"), net
    if wrap.how == "compile_inner":
        return ol.wrap_model(torch.compile(net, backend="aot_eager")), net
    if wrap.how == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in (net.enc, net.mid, net.head):
            fully_shard(block)
        return ol.wrap_model(fully_shard(net)), net
    return ol.wrap_model(net, **dict(wrap.ddp)), net


class Context:
    """What a call pattern's backward reads: the session and the step's GradScaler."""

    def __init__(self, ol, scaler) -> None:
        self.ol, self.scaler = ol, scaler


def train_step(ctx: Context, model, net: Net, cell: Cell, micro: list, opt) -> None:
    """One optimizer step over the step's micro-batches, as the cell's call pattern makes it."""
    pattern = PATTERNS[cell.pattern]
    opt.zero_grad()
    if pattern.forwards_first:
        losses = [loss_and_count(model, net, cell, x, t) for x, t, _ in micro]
        for loss, count in losses:
            pattern.back(ctx, loss, count)
    else:
        for x, t, _ in micro:
            pattern.back(ctx, *loss_and_count(model, net, cell, x, t))
    if ctx.scaler is not None:
        ctx.scaler.step(opt)  # unscales by 1 / scale first
        ctx.scaler.update()
    else:
        opt.step()


def in_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Floating-point inputs and targets in the model's dtype (float32 under autocast); token ids as they are."""
    return x.to(dtype) if x.is_floating_point() else x


def train(ol, model, net: Net, cell: Cell) -> list[list[int]]:
    """:data:`STEPS` steps of the cell; the dataset indices this rank trained on at each step."""
    pattern = PATTERNS[cell.pattern]
    scaler = torch.amp.GradScaler("cpu", init_scale=GRAD_SCALE) if pattern.scaler else None
    ctx, opt, seen = Context(ol, scaler), torch.optim.SGD(model.parameters(), lr=LR), []
    batches = iter(ol.data_loader(Data(LOSSES[cell.loss].criterion == "tokens")))
    for _ in range(STEPS):
        batch = next(batches)
        micro = batch if pattern.accumulation > 1 else [batch]
        dtype = next(net.parameters()).dtype
        micro = [(in_dtype(x, dtype), in_dtype(t, dtype), i) for x, t, i in micro]
        seen.append([int(i) for _, _, idx in micro for i in idx])
        train_step(ctx, model, net, cell, micro, opt)
        ol.step()
    return seen


def weights(net: nn.Module) -> dict[str, torch.Tensor]:
    """Full tensors (FSDP2's DTensors gathered), detached, float64."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().double().clone()
            for k, v in net.state_dict().items()}


def reference(loss: str, autocast: bool, steps: tuple[tuple[int, ...], ...]) -> dict[str, torch.Tensor]:
    """One process, no OmniLearn: the model (returning one tensor: every shape computes the same loss) trained
    with ``loss.backward()`` on the global batches ``steps``. Cached: many cells share one reference."""
    key = (loss, autocast, steps)
    if key not in _REFERENCES:
        _REFERENCES[key] = _train_reference(Cell("tensor", loss, "autocast" if autocast else "backward", "plain", ()),
                                            steps)
    return _REFERENCES[key]


_REFERENCES: dict[tuple, dict[str, torch.Tensor]] = {}


def _train_reference(cell: Cell, steps: tuple[tuple[int, ...], ...]) -> dict[str, torch.Tensor]:
    """:func:`reference`, uncached."""
    dtype = torch.float32 if PATTERNS[cell.pattern].autocast else torch.float64
    net = Net(cell.shape, LOSSES[cell.loss].criterion, dtype)
    data = Data(LOSSES[cell.loss].criterion == "tokens")
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    for idx in steps:
        x, t = in_dtype(data.x[list(idx)], dtype), in_dtype(data.t[list(idx)], dtype)
        opt.zero_grad()
        loss_and_count(net, net, cell, x, t)[0].backward()
        opt.step()
    return weights(net)


def session(cell: Cell):
    """The cell's session: its split from step 0 (the declared speeds of the static controller), nothing emulated."""
    k = PATTERNS[cell.pattern].accumulation
    return omnilearn.setup(global_batch=GLOBAL_BATCH, device="cpu", controller="static", emulator="none",
                           speeds=",".join(map(str, cell.split)), min_batch=k, accumulation_steps=k,
                           handle_signals=False, timeout_s=COLLECTIVE_TIMEOUT_S, quiet=True)


def train_cell(cell: Cell) -> tuple[Net | None, list[list[int]] | str]:
    """The cell's session on this rank: the trained module and the indices of each step, or (None, what it
    raised). A refusal (or a failure) is expected on every rank at the same point: the session is closed."""
    if WRAPS[cell.wrap].how.startswith("compile"):
        torch._dynamo.reset()  # a fresh cache: no recompile limit reached over the cells (a silent eager fallback)
    ol = session(cell)
    try:
        model, net = build(ol, cell)
        seen = train(ol, model, net, cell)
    except Exception as e:
        try:
            ol.finish()
        except Exception:
            ol.release()
        return None, f"{type(e).__name__}: {e}"
    ol.finish()
    return net, seen


def run_cell(cell: Cell) -> dict:
    """One cell on this rank: ``{"rel": ...}`` or ``{"raised": ...}``. One ``all_gather_object`` (the ranks' cell
    ids, indices or errors) checks that the ranks are in step and gives each step's global batch in rank order."""
    net, seen = train_cell(cell)
    gathered = gather_seen(cell.id, seen)
    if isinstance(gathered, dict):
        return gathered
    steps = tuple(tuple(i for rank_seen in gathered for i in rank_seen[s]) for s in range(STEPS))
    expected = reference(cell.loss, PATTERNS[cell.pattern].autocast, steps)
    return {"rel": max_relative(weights(net), expected)}


def gather_seen(cell_id: str, seen) -> list | dict:
    """Every rank's ``seen`` (its indices per step, or its error), in rank order; or ``{"raised": ...}`` where a
    rank raised. One ``all_gather_object``, which also checks that the ranks run the same cell."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (cell_id, seen))
    if any(other != cell_id for other, _ in gathered):
        raise RuntimeError(f"ranks out of step: cells {[other for other, _ in gathered]}")
    if isinstance(seen, str):
        return {"raised": seen}
    raised = [(r, other) for r, (_, other) in enumerate(gathered) if isinstance(other, str)]
    if raised:
        return {"raised": f"(on rank {raised[0][0]} only, not here) {raised[0][1]}"}
    return [other for _, other in gathered]


def worker(rank: int, world: int, store: str, out: str, todo: list[Cell]) -> None:
    """Every cell of ``todo`` in turn; one JSON line per cell in ``out/world<n>-rank<r>.jsonl``."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    with open(Path(out) / f"world{world}-rank{rank}.jsonl", "w") as lines:
        for cell in todo:
            start_s = time.perf_counter()
            result = run_cell(cell)
            lines.write(json.dumps({"id": cell.id, "rank": rank, "s": time.perf_counter() - start_s, **result}) + "\n")
            lines.flush()
    dist.barrier()
    dist.destroy_process_group()


def launch(todo: list[Cell], tmp: Path, timeout_s: float) -> dict[str, list[dict]]:
    """Run ``todo``: one launch per world size, started together (their ranks fill each other's waits); each
    cell id's results, one per rank that got to it (a launch that fails or passes ``timeout_s`` leaves the cells
    after it without results: their tests say so)."""
    deadline_s = time.monotonic() + timeout_s
    running = {world: start_ranks(worker, (world, str(tmp / f"store{world}"), str(tmp),
                                           [c for c in todo if c.world == world]), world, join=False)
               for world in sorted({c.world for c in todo})}
    for world, context in running.items():
        _join(context, world, deadline_s)
    results: dict[str, list[dict]] = {}
    for path in sorted(tmp.glob("world*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            results.setdefault(row["id"], []).append(row)
    return results


def _join(context, world: int, deadline_s: float) -> None:
    """Wait for a launch's ranks until ``deadline_s`` (monotonic), then end any left."""
    try:
        while not context.join(timeout=max(0.0, deadline_s - time.monotonic())):
            if time.monotonic() >= deadline_s:
                print(f"exactness launch on {world} ranks: still running at the deadline, ended")
                break
    except Exception as e:  # a rank raised: the results written so far still count
        print(f"exactness launch on {world} ranks: {type(e).__name__}: {str(e)[:2000]}")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()

"""The memory plan: each rank's memory, the bytes its model state and batch take, and the caps that fit.

Pure policy (no torch): :mod:`omnilearn.bsp.membytes` counts the bytes, this module decides.

``memory`` (a :class:`~omnilearn.config.BalanceConfig` field; ``memory=[...]`` in the API, ``memory = [...]`` in
TOML, ``--memory 2GiB,8GiB`` on the command line): each rank's memory in bytes, in rank order (one number for
every rank, or one per rank; ``"auto"``: each rank measures its CUDA device's). It is the CPU counterpart of
``max_batch``: declared where nothing can be measured, and each rank's batch cap then follows from what its model
state and its activations take, counted in the first steps (:func:`caps`), not guessed.

Where the state goes. Under FSDP2 every rank holds ``1/n`` of the parameters, gradients and optimizer state:
``fully_shard`` pads each shard to ``ceil(P/n)`` rows in every release OmniLearn supports (2.11 to 2.15), and no
release offers an uneven placement (no ``RaggedShard`` placement, no per-parameter owner rank; docs/memory.md has
the evidence). So the plan's state share is even, said in one line (:func:`state_line`), and what differs per rank
is the batch cap: the larger memory gets the larger share of every global batch, a share above a cap runs as
micro-batches, exactly. A plan of uneven state shares is not offered until torch can place them.

Run: ``python -m pytest -q tests/unit/test_memplan.py``
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

AUTO = "auto"
MARGIN = 0.15  # of each rank's memory the plan leaves free (the CUDA probe's margin: fragmentation, other tenants)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "tb": 10**12}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


class PlanError(ValueError):
    """A memory setting or plan that cannot work; the message names the value and the fix."""


def parse_memory(value: Any) -> tuple[int, ...] | int | str | None:
    """``memory`` in any accepted form (bytes, ``"24GiB"``, ``"16GB,80GB"``, a list of either, ``"auto"``) as
    bytes (one int, or a tuple per rank), ``"auto"`` or None."""
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() == AUTO:
        return AUTO
    said = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
    parts = value.split(",") if isinstance(value, str) else value if isinstance(value, (list, tuple)) else [value]
    sizes = [_bytes(p) for p in parts]
    if not sizes or any(s is None for s in sizes):
        raise PlanError(f"--memory {said} must be bytes with a unit, one for every worker or one per worker "
                           f"separated by commas (e.g. 16GiB,80GiB), or auto (each rank measures its CUDA device)")
    return sizes[0] if len(sizes) == 1 and not isinstance(value, (list, tuple)) else tuple(sizes)


def _bytes(part: Any) -> int | None:
    if isinstance(part, bool):
        return None
    if isinstance(part, int):
        return part if part > 0 else None
    found = _SIZE.match(str(part))
    if found is None or found.group(2).lower() not in _UNITS:
        return None
    size = int(float(found.group(1)) * _UNITS[found.group(2).lower()])
    return size if size > 0 else None


def rank_memory(memory: tuple[int, ...] | int | str | None, rank: int, workers: int) -> int | str | None:
    """This rank's entry of ``memory`` (checked against the worker count: one per worker)."""
    if isinstance(memory, tuple):
        if len(memory) != workers:
            raise PlanError(f"--memory {','.join(map(human, memory))} gives {len(memory)} sizes for {workers} "
                               f"workers; give one size, or one per worker in rank order")
        return memory[rank]
    return memory


def human(size: float) -> str:
    """Bytes in the largest binary unit that keeps a number of at least 1 (``1.5GiB``)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.4g}{unit}"
    return f"{int(size)}B"


@dataclass(frozen=True)
class Needs:
    """What one rank's training step holds, counted (bytes): ``state`` its shards of the parameters, gradients and
    optimizer state; ``block`` the largest unsharded unit's parameters and gradients while it computes (0 without
    FSDP2); ``per_sample`` the activations a sample keeps for backward."""

    state: int
    block: int
    per_sample: float

    @property
    def base(self) -> int:
        return self.state + self.block


def cap(memory: int, needs: Needs, rank: int, margin: float = MARGIN) -> int:
    """The most samples this rank's forward/backward may hold: what ``(1 - margin) x memory`` leaves after the state
    and the largest block, over the bytes a sample takes. A rank whose state alone does not fit is an error naming
    the bytes and the fixes."""
    room = (1.0 - margin) * memory - needs.base
    per_sample = max(needs.per_sample, 1.0)
    if room < per_sample:
        raise PlanError(f"rank {rank}: memory {human(memory)} (--memory) holds no sample: its model state takes "
                           f"{human(needs.state)} and the largest unsharded block {human(needs.block)}, one sample "
                           f"{human(per_sample)}, with {margin:.0%} kept free; give the rank more memory, shard over "
                           f"more workers, or train a smaller model")
    return int(room // per_sample)


def state_line(torch_version: str, needs: Needs, memory: int, capped: int, rank: int, sharded: bool) -> str:
    """The plan in one line: the state's share (even: why) and this rank's cap."""
    where = (f"even FSDP2 shards ({human(needs.state)} of state on each rank; torch {torch_version} has no uneven "
             f"placement of FSDP2 state)" if sharded else f"a full replica ({human(needs.state)} of state)")
    return (f"memory plan, rank {rank}: {human(memory)}: {where}, largest block {human(needs.block)}, "
            f"{human(needs.per_sample)} a sample -> at most {capped} samples a micro-batch")


def caps_problem(reported: list[int], global_batch: int, min_batch: int, accumulation_steps: int,
                 sharded: bool) -> str | None:
    """What the ranks' counted caps (per step: a micro-batch's cap x ``accumulation_steps``; 0: none) cannot do,
    in one line naming the fix, or None. A cap below ``min_batch`` would be lifted to it by the planner; under
    FSDP2 caps that cannot hold the global batch cannot be met by splitting one rank's share (every rank runs as
    many micro-batches: each forward all-gathers), only by more micro-batches on every rank."""
    low = [(rank, c) for rank, c in enumerate(reported) if 0 < c < min_batch]
    if low:
        rank, c = low[0]
        return (f"memory plan: rank {rank}'s memory holds {c} samples a step (counted), below min_batch={min_batch}: "
                f"give min_batch={c}, or the rank more memory")
    if sharded and all(reported) and sum(reported) < global_batch:
        per_micro = sum(c // accumulation_steps for c in reported)
        need = -(-global_batch // max(per_micro, 1))
        return (f"memory plan: the ranks' memory holds {sum(reported)} samples a step (counted caps "
                f"{','.join(map(str, reported))}) of global_batch={global_batch}, and under FSDP2 every rank runs "
                f"as many micro-batches: give accumulation_steps={need}, or a smaller global_batch")
    return None

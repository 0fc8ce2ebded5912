"""A BSP session's checkpoints: the session with the user's model, optimizer and LR scheduler, in one file.

Saving is a collective (every rank calls it at the same step boundary):

1. Mid control interval, BatchNorm statistics are first made equal
   everywhere (:meth:`~omnilearn.bsp.session.Session.sync_buffers`); at an
   interval end they already are (``omnilearn train`` saves only there).
2. Each rank's own part of the session state (its random streams, its rows
   of the open interval) goes to rank 0 as ``torch.save`` bytes
   (:func:`~omnilearn.distributed.collect.gather_bytes`; no pickled objects
   cross the wire).
3. Rank 0 writes one checkpoint through :class:`~omnilearn.checkpoint.CheckpointStore`
   (atomic, checksummed, the newest K kept), then tells every rank whether
   it worked, so a failed write (a full disk) raises the same error on every
   rank instead of leaving peers waiting.

Loading is a collective too: rank 0 reads the newest intact checkpoint
(``weights_only=True``, a damaged newest one skipped with a warning) and
broadcasts it as bytes, so other nodes need not see rank 0's disk. Every rank
then loads the model, optimizer, scheduler and session state. The session
state may come from another worker count (:meth:`Session.load_state_dict`:
the split is re-planned, the data position carries on).

The session's own ``state_dict`` (:func:`session_state`, :func:`load_session_state`,
elastic loading included) lives here too; ``Session`` delegates to it.

Run: ``python -m pytest -q tests/unit/test_checkpoint.py tests/faults/test_resume.py``
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch

from omnilearn.bsp.rng import load_rng_state, rng_state, seed_rank
from omnilearn.checkpoint import CheckpointError, CheckpointStore
from omnilearn.distributed.collect import broadcast_bytes, gather_bytes

Session = Any  # omnilearn.bsp.session.Session, which imports this module

STATE_FORMAT = 1  # of the session's state_dict


def to_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def from_bytes(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def _unwrapped(session: Session, obj: Any) -> Any:
    """The user's model rather than its DDP wrapper (same parameters; keys without ``module.``)."""
    return session.module if obj is session.model and session.model is not None else obj


def _cpu(state: dict) -> dict:
    return {k: v.detach().cpu() if torch.is_tensor(v) else v for k, v in state.items()}


def save(session: Session, directory: str | Path, objects: dict[str, Any], *, keep: int = 3,
         extra: dict | None = None, meta: dict | None = None) -> Path | None:
    """Write a checkpoint of the session and ``objects`` (model/optimizer/scheduler); rank 0's path, else None."""
    if not session.interval_ended:
        session.sync_buffers()
    state = session.state_dict()
    mine = f"rank{session.rank}"
    parts = gather_bytes(session.ctx, to_bytes(state.pop(mine)))
    path, error = None, ""
    if parts is not None:
        for rank, data in enumerate(parts):
            state[f"rank{rank}"] = from_bytes(data)
        full: dict[str, Any] = {"session": state, "extra": extra or {}}
        for name, obj in objects.items():
            if obj is not None:
                obj = _unwrapped(session, obj)
                full[name] = _cpu(obj.state_dict()) if name == "model" else obj.state_dict()
        info = {"workers": session.world_size, "global_batch": session.global_batch, **(meta or {})}
        try:
            path = CheckpointStore(directory, keep).save(session.next_step, full, info)
        except Exception as e:  # every rank raises it, below
            error = f"{type(e).__name__}: {e}"
    error = broadcast_bytes(session.ctx, error.encode() if session.is_main else None).decode()
    if error:
        raise CheckpointError(f"checkpoint at step {session.next_step} was not written: {error}")
    return path


def load(session: Session, directory: str | Path, objects: dict[str, Any]) -> dict | None:
    """Load the newest checkpoint into the session and ``objects``; its ``extra`` dict, or None when there is none."""
    data = b""
    if session.is_main:
        latest = CheckpointStore(directory).load_latest()
        data = to_bytes(latest[1]) if latest is not None and session.ctx.grouped else b""
        if latest is not None and not session.ctx.grouped:
            return _apply(session, latest[1], objects)
    data = broadcast_bytes(session.ctx, data)
    if not data:
        return None
    return _apply(session, from_bytes(data), objects)


def _apply(session: Session, state: dict, objects: dict[str, Any]) -> dict:
    for name, obj in objects.items():
        if obj is None:
            continue
        if name not in state:
            raise CheckpointError(f"the checkpoint holds no {name} state (saved without {name}=); load without it")
        _unwrapped(session, obj).load_state_dict(state[name])
    session.load_state_dict(state["session"])
    return state.get("extra", {})


def session_state(session: Session) -> dict:
    """The session's ``state_dict``: plain values and tensors; this rank's own part under ``rank<r>``."""
    mine = {"rng": rng_state(session.device), "window": [list(r) for r in session.ledger.rows()]}
    if session.telemetry is not None:
        mine["telemetry"] = session.telemetry.state_dict()
    return {"format": STATE_FORMAT, "world_size": session.world_size, "global_batch": session.cfg.global_batch,
            "steps_done": session.steps_done, "next_step": session.next_step, "train_s": session.clock.at_last_step_s,
            "loop": session.loop.state_dict(), "schedule": session.schedule.state_dict(),
            "sampler": session.sampler.state_dict(), f"rank{session.rank}": mine}


def load_session_state(session: Session, state: dict) -> None:
    """Restore :func:`session_state` (same global batch).

    From another worker count (elastic): the data position, step count and
    training time carry on; the split starts afresh from the declared speeds
    for the new workers and the controller relearns them; ranks the old run
    did not have are seeded from ``(seed, rank)``. The samples of every step
    do not depend on the split, so the weights still follow the same path.
    """
    if state.get("format") != STATE_FORMAT:
        raise ValueError(f"session state format {state.get('format')!r}; this version reads {STATE_FORMAT}")
    if state["global_batch"] != session.global_batch:
        raise ValueError(f"session state of global batch {state['global_batch']} loaded into a session of "
                         f"{session.global_batch}: resume with --global-batch {state['global_batch']}")
    same = int(state["world_size"]) == session.world_size
    if same:
        session.loop.load_state_dict(state["loop"])
        session.schedule.load_state_dict(state["schedule"])
    session.sampler.load_state_dict(state["sampler"])
    session.steps_done, session.next_step = int(state["steps_done"]), int(state["next_step"])
    session.clock.restore(float(state["train_s"]))
    mine = state.get(f"rank{session.rank}")
    if mine is not None:
        load_rng_state(mine["rng"], session.device)
        if same:
            session.ledger.resolved = [[float(v) for v in r] for r in mine["window"]]
    else:
        seed_rank(session.cfg.seed, session.rank)
    session.rng_restored = True
    session.resumed_from = (session.next_step, int(state["world_size"]))
    session.pending_telemetry = (state.get("rank0") or {}).get("telemetry", {})
    session.restore_telemetry()

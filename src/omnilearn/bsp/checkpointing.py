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
   (every value checked to load under ``weights_only=True``, then atomic,
   checksummed, the newest K kept), then tells every rank whether it worked,
   so a failed write (a full disk, a numpy scalar in ``extra``) raises the
   same one-line error on every rank instead of leaving peers waiting.

Loading is a collective too (:func:`fetch_latest`): rank 0 reads the newest
intact checkpoint's file bytes (checksum verified; a damaged newest one is
set aside with a warning for the one before) and broadcasts them in CPU
pieces over a gloo group (a side group under NCCL), so other nodes need not
see rank 0's disk and no rank holds more than one copy of the file, none on
its device. Every rank then deserialises them once on the CPU
(``weights_only=True``) and loads the model, optimizer, scheduler and
session state. The outcome is the same on every rank: the state, None when
the directory holds no checkpoint at all, or the same :class:`CheckpointError`
(every checkpoint damaged, or one that passed its checksum and does not load:
no fallback then). The session state may come from another worker count
(:meth:`Session.load_state_dict`: the split is re-planned, the data position
carries on). What the data position means (seed, dataset length, global
batch, steps per epoch) is saved with it and checked first
(:func:`check_resume`): a run that would read other samples at that position
is refused in one line naming the saved value, the value now and the keyword.

The session's own ``state_dict`` (:func:`session_state`, :func:`load_session_state`,
elastic loading included) lives here too; ``Session`` delegates to it. Each
rank's part holds the state of its ``DataLoader``'s own generator
(:func:`loader_generator_state`), so a resumed run's loader draws the numbers
(worker seeds) an uninterrupted one draws.

Run: ``python -m pytest -q tests/unit/test_checkpoint.py tests/dist/test_checkpoint_load.py tests/faults/test_resume.py``
"""

from __future__ import annotations

import io
import json
import warnings
from pathlib import Path
from typing import Any

import torch

from omnilearn.bsp import sharded
from omnilearn.bsp.rng import load_rng_state, rank_seed, rng_state, seed_rank
from omnilearn.checkpoint import CheckpointError, CheckpointStore, step_of
from omnilearn.config import ConfigError
from omnilearn.data.position import UnverifiedResumeWarning, keyword
from omnilearn.decisions import MAX_STRETCH
from omnilearn.distributed.collect import broadcast_bytes, broadcast_chunks, gather_bytes
from omnilearn.distributed.group import DistContext, cpu_group

Session = Any  # omnilearn.bsp.session.Session, which imports this module

STATE_FORMAT = 1  # of the session's state_dict
REPLAY_LIMIT = 100_000  # draws searched for the loader generator's place in its seeded stream


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


def objects_state(session: Session, objects: dict[str, Any]) -> dict[str, Any]:
    """The ``state_dict`` of each object given (the model unwrapped from DDP, on the CPU), by name."""
    return {name: _cpu(_unwrapped(session, obj).state_dict()) if name == "model" else obj.state_dict()
            for name, obj in objects.items() if obj is not None}


def save(session: Session, directory: str | Path, objects: dict[str, Any], *, keep: int = 3,
         extra: dict | None = None, meta: dict | None = None, generation: int | None = None) -> Path | None:
    """Write a checkpoint of the session and ``objects`` (model/optimizer/scheduler); rank 0's path, else None.
    ``generation``: where the shards went (:meth:`~omnilearn.checkpoint.CheckpointStore.save`)."""
    if not session.interval_ended:
        session.sync_buffers()
    state = gathered_state(session)
    path, error = None, ""
    if session.is_main:
        try:  # a state_dict() that raises is rank 0's failure: every rank raises it, below, naming rank 0
            full: dict[str, Any] = {"session": state, "extra": extra or {}, **objects_state(session, objects)}
            info = {"workers": session.world_size, "global_batch": session.global_batch, **(meta or {})}
            path = CheckpointStore(directory, keep).save(session.next_step, full, info, generation=generation)
        except CheckpointError as e:  # a value that would not load back: it names the field
            error = str(e)
        except Exception as e:  # every rank raises it, below
            error = (f"checkpoint at step {session.next_step} was not written: rank 0 raised "
                     f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    error = broadcast_bytes(session.ctx, error.encode() if session.is_main else None).decode()
    if error:
        raise CheckpointError(error)
    return path


def save_with_shards(session: Session, directory: str | Path, objects: dict[str, Any], *, keep: int = 3,
                     extra: dict | None = None) -> Path | None:
    """A sharded (FSDP2) model: its and the optimizer's shards through DCP, then :func:`save` of the rest.

    The shards (``step-<n>.dcp``, every rank) are the first part of :func:`omnilearn.checkpoint.commit`'s
    sequence: ``step-<n>.pt`` (the session, scheduler, ``extra``) and its manifest, the mark, come after every
    rank's shards; the store then prunes shard directories with their checkpoints and sweeps those of cut saves.
    """
    model, optimizer = objects["model"], objects.get("optimizer")
    generation = CheckpointStore(directory).next_generation(session.next_step)  # shared storage: one answer
    sharded.save_sharded(model, optimizer, directory, session.next_step, generation)  # a collective
    rest = {name: obj for name, obj in objects.items() if name not in ("model", "optimizer")}
    return save(session, directory, rest, keep=keep, extra=extra, meta={"sharded": True}, generation=generation)


def gathered_state(session: Session) -> dict:
    """``session.state_dict()`` with every rank's own part (``rank<r>``) on rank 0 (a collective: every rank calls
    it); the other ranks get the state without their part. What every checkpoint of the session holds (ours,
    Lightning's, Hugging Face's)."""
    state = session.state_dict()
    parts = gather_bytes(session.ctx, to_bytes(state.pop(f"rank{session.rank}")))
    for rank, data in enumerate(parts or []):
        state[f"rank{rank}"] = from_bytes(data)
    return state


def load(session: Session, directory: str | Path, objects: dict[str, Any]) -> dict | None:
    """Load the newest checkpoint into the session and ``objects``; its ``extra`` dict, or None when there is none.

    :class:`CheckpointError` on every rank when the directory holds checkpoints and none can be used. A
    sharded model (FSDP2) and its optimizer load from the checkpoint's shard directory, at any world size.
    """
    found = fetch_latest(session.ctx, CheckpointStore(directory))
    if found is None:
        return None
    path, data = found
    state = CheckpointStore.decode(data, path)  # every rank, once, on the CPU; the same error everywhere
    del found, data  # the file's bytes go before the state is copied into the model
    if sharded.is_sharded(objects.get("model")):
        step, generation = step_of(path)
        shards = sharded.dcp_dir(path.parent, step, generation)
        if not shards.is_dir():
            raise CheckpointError(f"{path} has no shard directory {shards.name} beside it: it was saved without a "
                                  "sharded model (load it without model=, or into an unsharded model)")
        sharded.load_sharded(objects["model"], objects.get("optimizer"), path.parent, step, generation)
        objects = {name: obj for name, obj in objects.items() if name not in ("model", "optimizer")}
    return _apply(session, state, objects)


def fetch_latest(ctx: DistContext, store: CheckpointStore) -> tuple[Path, bytearray] | None:
    """(path, verified file bytes) of the newest intact checkpoint on every rank; None when there is none.

    Rank 0 reads the file; the bytes go out in CPU pieces (:func:`broadcast_chunks`). Rank 0's failure
    (every checkpoint damaged, a format of another version, an unreadable directory) is raised on every rank.
    """
    header, data = {}, None
    if ctx.is_main:
        try:
            found = store.read_latest()
        except Exception as e:  # every rank raises it, below
            header = {"error": str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"}
        else:
            if found is not None:
                header, data = {"path": str(store.data_path(found[0]))}, found[1]
    with cpu_group(ctx) as group:
        sent = bytearray(json.dumps(header).encode()) if ctx.is_main else None
        header = json.loads(broadcast_chunks(ctx, sent, group))
        if "path" in header:
            data = broadcast_chunks(ctx, data, group)
    if "error" in header:
        raise CheckpointError(header["error"])
    return (Path(header["path"]), data) if "path" in header else None


def _apply(session: Session, state: dict, objects: dict[str, Any]) -> dict:
    check_resume(session, state["session"])  # before the model and optimizer change
    for name, obj in objects.items():
        if obj is None:
            continue
        if name not in state:
            raise CheckpointError(f"the checkpoint holds no {name} state (saved without {name}=); load without it")
        _unwrapped(session, obj).load_state_dict(state[name])
    session.load_state_dict(state["session"])
    return state.get("extra", {})


def session_state(session: Session, rows: bool = True) -> dict:
    """The session's ``state_dict``: plain values and tensors; this rank's own part under ``rank<r>``
    (``rows=False``: without the open window's rows, so every rank of a resume starts the same window)."""
    mine = {"rng": rng_state(session.device), "window": [list(r) for r in session.ledger.rows()] if rows else []}
    loader_rng = loader_generator_state(session)
    if loader_rng is not None:
        mine["loader_generator"] = loader_rng
    if session.telemetry is not None:
        mine["telemetry"] = session.telemetry.state_dict()
        if not rows:  # the open window's steps are trained but never recorded now: the run's count has them
            mine["telemetry"]["steps"] = session.next_step
    return {"format": STATE_FORMAT, "world_size": session.world_size, "global_batch": session.cfg.global_batch,
            "steps_done": session.steps_done, "next_step": session.next_step, "train_s": session.clock.at_last_step_s,
            "loop": session.loop.state_dict(), "schedule": session.schedule.state_dict(),
            "sampler": session.sampler.state_dict(), "data": session.sampler.basis() or {},
            "checks": session.checks_on, "stretch": session.window_steps // session.cfg.control_interval,
            "intervals": session.intervals, f"rank{session.rank}": mine}


def load_session_state(session: Session, state: dict) -> None:
    """Restore :func:`session_state` (same global batch, same data: :func:`check_resume`).

    From another worker count (elastic): the data position, step count and
    training time carry on; the split starts afresh from the declared speeds
    for the new workers and the controller relearns them; ranks the old run
    did not have are seeded from ``(seed, rank)``. The samples of every step
    do not depend on the split, so the weights still follow the same path.
    """
    check_resume(session, state)
    same = int(state["world_size"]) == session.world_size
    if same:
        session.loop.load_state_dict(state["loop"])
        session.schedule.load_state_dict(state["schedule"])
        session.checks_on = bool(state.get("checks", True))  # as the last interval left it (older states: on)
        session.intervals = int(state.get("intervals", 0))  # the stretch's warm-up goes on (elastic: afresh)
        if session.cfg.min_window_s > 0:  # as the last interval stretched it (older states: not stretched)
            session.window_steps = session.cfg.control_interval * min(int(state.get("stretch", 1)), MAX_STRETCH)
    session.sampler.load_state_dict(state["sampler"])
    session.steps_done, session.next_step = int(state["steps_done"]), int(state["next_step"])
    session.clock.restore(float(state["train_s"]))
    mine = state.get(f"rank{session.rank}")
    if mine is not None:
        load_rng_state(mine["rng"], session.device)
        generator = _loader_generator(session)
        if generator is not None and "loader_generator" in mine:
            generator.set_state(mine["loader_generator"])
        if same:
            session.ledger.resolved = [[float(v) for v in r] for r in mine["window"]]
    else:
        seed_rank(session.cfg.seed, session.rank)
    session.rng_restored = True
    session.resumed_from = (session.next_step, int(state["world_size"]))
    session.pending_telemetry = (state.get("rank0") or {}).get("telemetry", {})
    session.restore_telemetry()


def check_resume(session: Session, state: dict) -> None:
    """Refuse, before anything is restored, a state this session would read differently: another format, global
    batch, or data basis (seed, dataset length, steps per epoch: :mod:`omnilearn.data.position`; checked when the
    dataset is known). A state from before the basis was saved is loaded unchecked, with a warning."""
    if state.get("format") != STATE_FORMAT:
        raise ValueError(f"session state format {state.get('format')!r}; this version reads {STATE_FORMAT}")
    if state["global_batch"] != session.global_batch:
        raise ConfigError(f"the checkpoint was saved with global batch {state['global_batch']} but this session has "
                          f"{session.global_batch}: resume with {keyword('global_batch', state['global_batch'])}")
    if "data" not in state:
        warnings.warn("the checkpoint's session state predates the data checks (seed, dataset length, steps per "
                      "epoch): the resume cannot check them; use the seed and data it was saved with",
                      UnverifiedResumeWarning, stacklevel=3)
    session.sampler.expect(state.get("data"))


def _loader_generator(session: Session) -> torch.Generator | None:
    """The session's ``DataLoader``'s own generator (map-style data; None for streams and window sampling)."""
    generator = getattr(getattr(session.loader, "loader", None), "generator", None)
    return generator if isinstance(generator, torch.Generator) else None


def loader_generator_state(session: Session) -> torch.Tensor | None:
    """The loader generator's state as it was when the ``DataLoader`` iterator serving the next step was made.

    A ``DataLoader`` draws one number from its generator per iterator (its workers' seeds), and a resumed
    run makes a new iterator for its first step. So: when the iterator serving the next step exists already
    (this process handed out a step, and the next one is mid-epoch or the workers are persistent: one
    iterator for the run), the state before its draw, found by replaying the generator's seeded stream;
    else the state now (the next iterator draws from it). Not found within :data:`REPLAY_LIMIT` draws: now.
    """
    generator = _loader_generator(session)
    if generator is None:
        return None
    now = generator.get_state()
    persistent = bool(getattr(session.loader.loader, "persistent_workers", False))
    if session.ledger.last_started < 0 or not (session.sampler.offset > 0 or persistent):
        return now
    replay = torch.Generator().manual_seed(rank_seed(session.cfg.seed, session.rank))
    state = previous = replay.get_state()
    for _ in range(REPLAY_LIMIT):
        if torch.equal(state, now):
            return previous
        previous = state
        torch.empty((), dtype=torch.int64).random_(generator=replay)  # the draw DataLoader makes per iterator
        state = replay.get_state()
    return now

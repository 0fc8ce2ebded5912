"""The session's state and checkpoints: ``state_dict``, ``load_state_dict``, ``save_checkpoint``, ``load_checkpoint``.

A mixin of :class:`~omnilearn.bsp.session.Session`; the mechanics (what the
state holds, the checksummed store, FSDP2's DCP shards, elastic resumes at
another worker count) live in :mod:`omnilearn.bsp.checkpointing`. Every
method reads the meeting in flight first (every rank calls them at the same
point), so a checkpoint holds its outcome whenever a run without it would
read it.

Run: ``python -m pytest -q tests/unit/test_session_state.py tests/dist/test_checkpoint_load.py``
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from omnilearn.bsp import checkpointing, sharded
from omnilearn.checkpoint import CheckpointError


class Persistence:
    """The session's state and checkpoints (see the module docstring)."""

    def state_dict(self) -> dict:
        """Everything but the user's model and optimizer, as plain values and tensors (a ``Stateful``).

        Rank-specific parts (random streams, this interval's rows; on rank 0
        the record's counters) sit under ``rank<r>``.
        """
        self._read_meeting()  # every rank calls it at the same point
        return checkpointing.session_state(self)

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (same global batch; call before training on).

        From another worker count (elastic) the data position, step count and
        training time carry on and the split is re-planned for the new workers
        (:func:`omnilearn.bsp.checkpointing.load_session_state`).
        """
        self._read_meeting()
        checkpointing.load_session_state(self, state)
        caps = getattr(self.loop, "caps", None)
        if caps is not None and self.resumed_from is not None and self.resumed_from[1] == self.world_size:
            cap = int(caps.reported[self.rank])  # this rank's learned cap, as the planner held it
            if cap < 2**62:
                self.memory.restore(cap)

    def restore_telemetry(self) -> None:
        """Once the record exists after a resume: this rank's rows of redone steps are void, and rank 0's Telemetry
        gets the loaded checkpoint's record counters."""
        if self.resumed_from is not None and self.rank_rows is not None and not self.rows_resumed:
            self.rank_rows.resume(self.resumed_from[0])
            self.rows_resumed = True
        if self.telemetry is not None and self.resumed_from is not None and self.pending_telemetry is not None:
            self.telemetry.resume(self.pending_telemetry, *self.resumed_from)
            self.pending_telemetry = None

    def save_checkpoint(self, directory: str | Path, *, model: nn.Module | None = None, optimizer=None,
                        scheduler=None, extra: dict | None = None, keep: int = 3) -> Path | None:
        """Checkpoint the session and the given objects into ``directory`` (every rank calls it after ``step()``).

        Rank 0 writes ``step-<next step>.pt`` atomically with a checksum and
        keeps the newest ``keep``; it returns the path (None elsewhere).
        ``extra``: plain values or tensors of your own (epoch counters, best
        accuracy...); a value ``torch.load(weights_only=True)`` would not read
        back (a numpy scalar, a ``Path``) raises
        :class:`~omnilearn.checkpoint.CheckpointError` naming the field, before
        anything is written.
        """
        objects = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
        if model is not None:
            self.save_on_failure(directory, **objects)
        self._read_meeting()  # the checkpoint holds its outcome, whenever a run without it would read it
        try:
            with self.paused():
                if sharded.is_sharded(model):  # FSDP2: shards through DCP first, then the commit mark
                    return checkpointing.save_with_shards(self, directory, objects, keep=keep, extra=extra)
                return checkpointing.save(self, directory, objects, keep=keep, extra=extra)
        except CheckpointError:  # told to every rank alike: each raises it, and may go on
            raise
        except Exception as e:  # one rank's (a state_dict() that raises): the others wait in the save's collectives
            self._fail(e)
            raise

    def load_checkpoint(self, directory: str | Path, *, model: nn.Module | None = None, optimizer=None,
                        scheduler=None) -> bool:
        """Resume from the newest intact checkpoint in ``directory``; False (nothing changed) when it holds none.

        Call it on every rank after ``wrap_model()`` and ``data_loader()`` and
        before training. A damaged newest checkpoint (checksum, cut short,
        missing) is set aside for the one before (a warning). When the
        directory holds checkpoints and none is usable (all damaged, or the
        newest passed its checksum and does not load) every rank raises
        :class:`~omnilearn.checkpoint.CheckpointError` naming the file: a resume
        never quietly becomes a fresh start. What was saved as ``extra`` is in
        :attr:`checkpoint_extra`.
        """
        objects = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
        if model is not None:
            self.save_on_failure(directory, **objects)
        extra = checkpointing.load(self, directory, objects)  # FSDP2: from the shards (DCP reshards)
        self.checkpoint_extra = extra or {}
        return extra is not None

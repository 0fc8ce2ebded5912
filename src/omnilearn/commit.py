"""The one save sequence every front door follows: a checkpoint is complete or absent.

    commit(mark, write_parts, mark_bytes, prune)

1. ``write_parts()`` writes every part of the checkpoint (each atomically, by the caller);
2. the commit mark comes last: temp file, fsync, rename, directory fsync. A reader counts a checkpoint only by
   its mark, so a kill anywhere before leaves the previous checkpoint as the newest complete one;
3. only then ``prune()`` rotates older checkpoints away: nothing is removed before the new one is whole.

Who uses it: :class:`omnilearn.checkpoint.CheckpointStore` (the API, ``omnilearn train``, FSDP2's DCP shards as
a part), ``OmniLearnTrainer`` (Trainer's folder as the parts, ``omnilearn_session.pt`` as the mark, Trainer's
``save_total_limit`` rotation as the prune) and the TensorFlow runtime (``omnilearn.tf.checkpointing``).
Lightning's checkpoint is one file Lightning writes, with the session state inside it.

No torch here (the TensorFlow runtime uses it too).

Run: ``python -m pytest -q tests/unit/test_checkpoint.py -k commit``
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Callable

from omnilearn.observe.rundir import write_atomic


class CheckpointWarning(UserWarning):
    """A damaged checkpoint was set aside for an older one, or older ones could not be pruned."""


def commit(mark: Path, write_parts: Callable[[], object], mark_bytes: Callable[[], bytes],
           prune: Callable[[], object] | None = None) -> Path:
    """The one save sequence for every door: complete or absent, nothing rotated away before the new one is whole.

    1. ``write_parts()``: every part of the checkpoint (each written atomically by the caller; a failure raises
       here and nothing below runs: no mark, nothing pruned);
    2. the commit mark, last: ``mark_bytes()`` (called after the parts: it may hold their checksums) written to a
       temporary file beside ``mark``, fsynced, renamed over ``mark``, the directory fsynced
       (:func:`~omnilearn.observe.rundir.write_atomic`). A reader counts a checkpoint only by its mark;
    3. ``prune()``: rotate older checkpoints away, only now. A prune that fails (an ``OSError``) leaves the new
       checkpoint complete: a :class:`CheckpointWarning`, not an error (the next save prunes again).

    Returns ``mark``.
    """
    write_parts()
    data = mark_bytes()
    write_atomic(Path(mark), lambda f: f.write(data))
    if prune is not None:
        try:
            prune()
        except OSError as e:
            warnings.warn(f"checkpoint {mark} is complete, but removing older checkpoints failed ({e}); they stay "
                          "until a later save prunes them", CheckpointWarning, stacklevel=2)
    return Path(mark)

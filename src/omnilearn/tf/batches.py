"""A TensorFlow worker's batches of each global step (:class:`WorkerBatches`), and the model files' helpers.

Run: ``python -m pytest -q tests/tf``
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Iterator

import numpy as np

from omnilearn.config import ConfigError


class WorkerBatches:
    """This worker's ``(x, y)`` slice of each global step of an epoch (``set_epoch`` optional, as with PyTorch)."""

    def __init__(self, session, x: np.ndarray, y: np.ndarray) -> None:  # a TFSession
        self.session, self.x, self.y, self.epoch = session, x, y, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def steps(self) -> range:
        s = self.session
        spe, total = s.run.steps_per_epoch, s.run.total_steps
        end = (self.epoch + 1) * spe if total is None else min((self.epoch + 1) * spe, total)
        return range(max(self.epoch * spe, s.next_step), end)

    def __len__(self) -> int:
        return len(self.steps())

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        s = self.session  # without set_epoch, each pass serves the epoch after the last step trained
        self.epoch = max(self.epoch, s.next_step // s.run.steps_per_epoch)
        perm = s.plan.permutation(self.epoch)
        for step in self.steps():
            s.begin(step)
            idx = s.plan.worker_indices(step, s.schedule.at(step), s.rank, perm)
            yield self.x[idx], self.y[idx]


def save_weights(model, path: Path) -> None:
    """``model.save_weights`` to a temporary name, then renamed: a crash never leaves half a file."""
    tmp = path.with_name(f".{os.getpid()}-{time.monotonic_ns()}.weights.h5")
    try:
        model.save_weights(str(tmp))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def refuse_model_fit(*_args, **_kwargs):
    """``model.fit`` on a model a session balances: one line naming ``ol.fit`` instead."""
    raise ConfigError("model.fit() on a model OmniLearn balances: call ol.fit(model, data, epochs=..., callbacks=...) "
                      "instead (Keras' fit cannot change each worker's batch)")

"""``RUN_DIR/model.pt``: a PyTorch model's weights, written atomically (the runtimes that train torch modules).

The TensorFlow runtime writes ``model.weights.h5`` instead
(:func:`omnilearn.tf.batches.save_weights`); the recorders take either as a
``save(run_dir)`` callback, so :mod:`omnilearn.observe` needs no torch itself.

Run its tests: ``python -m pytest -q tests/unit/test_rundir.py``
"""

from __future__ import annotations

from pathlib import Path

import torch

from omnilearn.observe.rundir import write_atomic


def save_model(run_dir: Path, model: torch.nn.Module | None, state: dict | None = None) -> None:
    """``RUN_DIR/model.pt``: the model's ``state_dict`` as CPU tensors (``torch.load(..., weights_only=True)``).

    ``state``: that state, already gathered (a sharded model's full tensors, :func:`omnilearn.bsp.sharded.full_state`).
    """
    state = {k: v.detach().cpu() for k, v in (model.state_dict() if state is None else state).items()}
    write_atomic(Path(run_dir) / "model.pt", lambda f: torch.save(state, f))


def saver(model: torch.nn.Module | None, state: dict | None = None):
    """The ``save(run_dir)`` callback of a recorder's ``finish`` for ``model`` (None: nothing to save)."""
    return None if model is None else (lambda run_dir: save_model(run_dir, model, state))

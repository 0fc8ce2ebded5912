"""Is the model being resumed the one its TensorFlow checkpoint was saved from? A refusal naming where it differs.

``tf.train.Checkpoint`` matches a Keras 3 model's variables by position
(``optimizer/_trainable_variables/<i>``, ``model/_functional/_operations/<i>``),
not by name: a layer added, removed or reshaped would load another layer's
values, or keep its initial ones, without a word (``expect_partial``).
So a checkpoint's ``session.json`` lists ``[path, shape, dtype]`` of the
model's weights and the optimizer's variables in order (:func:`shapes`), and a resume
compares them position by position before anything is read
(:func:`refuse_changed`). Names may differ (Keras numbers layers per
process: ``dense_2``); only shapes and dtypes count.

No TensorFlow import. Run: ``python -m pytest -q tests/tf/test_tf_trust.py -k changed``
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omnilearn.config import ConfigError

SHOWN = 3  # differences named in a refusal


def shapes(variables) -> list[list]:
    """``[path, shape, dtype]`` of each variable, in order (what a checkpoint's positions mean)."""
    return [[getattr(v, "path", v.name), list(v.shape), str(getattr(v.dtype, "name", v.dtype))] for v in variables]


def refuse_changed(path: Path, state: dict[str, Any], model, optimizer) -> None:
    """ConfigError naming the first variables where ``model``/``optimizer`` differ from the checkpoint's."""
    saved = state.get("variables")
    if saved is None:  # a checkpoint of an earlier version: TensorFlow's own check after the read
        return
    for part, now in (("model", shapes(model.weights)), ("optimizer", shapes(optimizer.variables))):
        diffs = differences(saved[part], now)
        if diffs:
            more = f" and {len(diffs) - SHOWN} more" if len(diffs) > SHOWN else ""
            raise ConfigError(f"checkpoint {path} was saved from another {part} ({len(saved[part])} variables, "
                              f"{len(now)} now): {'; '.join(diffs[:SHOWN])}{more}; resume with the {part} it was "
                              "saved from, or start a new run in another out=")


def differences(saved: list[list], now: list[list]) -> list[str]:
    """Position by position: a variable new here, one missing here, or another shape or dtype."""
    said = []
    for i in range(max(len(saved), len(now))):
        if i >= len(saved):
            said.append(f"{now[i][0]} {tuple(now[i][1])} is not in it")
        elif i >= len(now):
            said.append(f"its {saved[i][0]} {tuple(saved[i][1])} is not in this one")
        elif saved[i][1:] != now[i][1:]:
            said.append(f"{now[i][0]} is {tuple(now[i][1])} {now[i][2]} where it has {saved[i][0]} "
                        f"{tuple(saved[i][1])} {saved[i][2]}")
    return said

"""What a saved data position means, and the one-line refusal when a resumed run would read it differently. Pure.

A checkpoint keeps the sampler's place as ``(epoch, offset)`` in steps. Which
samples those steps are depends on the plan: for a dataset its length, the
global batch, the seed of the per-epoch shuffle, the steps per epoch and what
happens to the last ``N mod B`` samples (dropped); for ``random_indices(high)``
the range, the batch and the seed; for a stream only the batch (its items are
skipped by count). :func:`basis` is that dict, saved beside the place
(``"data"`` in the session's state); :func:`mismatch` compares a saved one with
the run's own and names the first difference, the value saved, the value now
and the fix. Another seed or dataset would otherwise silently repeat or skip
samples.

A checkpoint written before the basis was saved has none: :func:`mismatch`
then has nothing to check (the caller warns).

The fix names the ``omnilearn.setup`` keyword (what the library API, Hugging
Face's ``omnilearn=dict(...)`` and Lightning's strategies take) and the CLI flag.

Run: ``python -m pytest -q tests/unit/test_resume_checks.py``
"""

from __future__ import annotations

from typing import Any

class UnverifiedResumeWarning(UserWarning):
    """A checkpoint from before the data basis was saved: its seed and dataset could not be checked."""


KINDS = {"dataset": "a dataset", "stream": "a stream (IterableDataset)", "random_indices": "random_indices()"}


def basis(plan: Any) -> dict[str, Any]:
    """What ``plan``'s step -> samples mapping depends on (plain values), by the plan's ``RESUME_FIELDS``."""
    out: dict[str, Any] = {"kind": plan.KIND}
    for name in plan.RESUME_FIELDS:
        out[name] = getattr(plan, name)
    return out


def keyword(name: str, value: Any) -> str:
    """``seed=0 (omnilearn.setup keyword; omnilearn train --seed 0)``: the fix in the API's words, and the flag of the
    one command that has it (``omnilearn launch`` has none: its script's ``setup()`` sets it)."""
    return f"{name}={value} (omnilearn.setup keyword; omnilearn train --{name.replace('_', '-')} {value})"


def _fix(name: str, saved: dict[str, Any]) -> str:
    if name in ("seed", "global_batch"):
        return f"resume with {keyword(name, saved[name])}"
    return (f"resume with the data it was saved with ({saved.get('dataset_len')} samples, "
            f"{keyword('global_batch', saved.get('global_batch'))}), or start afresh in another checkpoint directory")


_WHAT = {"global_batch": "global batch", "dataset_len": "data size", "seed": "seed",
         "steps_per_epoch": "steps per epoch", "partial_batch": "an epoch's last partial batch"}


def mismatch(saved: dict[str, Any] | None, now: dict[str, Any]) -> str | None:
    """The one-line refusal when ``saved`` (a checkpoint's :func:`basis`) differs from ``now``; None when it
    matches or there is nothing saved to compare."""
    if not saved:
        return None
    if saved.get("kind") != now["kind"]:
        return (f"the checkpoint's data position is in {KINDS.get(saved.get('kind'), saved.get('kind'))} but this "
                f"run reads {KINDS[now['kind']]}: resume with the same kind of data source")
    for name in now:
        if name in saved and saved[name] != now[name]:
            what = _WHAT.get(name, name)
            return (f"the checkpoint was saved with {what} {saved[name]} but this run has {what} {now[name]}: its "
                    f"data position would point at other samples (some repeated, some skipped); {_fix(name, saved)}")
    return None

"""``--out`` for a new run: refused (one line) when it already holds one, naming ``--resume`` as well as ``--overwrite``.

:func:`check_new_out` is :func:`omnilearn.observe.rundir.check_out` with the way on that a relaunch into the same
``--out`` usually wants: ``--resume`` continues the run there from its newest checkpoint. Used by ``omnilearn
train``'s preflight (:mod:`omnilearn.experiments.train.preflight`) and ``omnilearn launch``
(:mod:`omnilearn.experiments.launch.script`). No torch here.

Run: ``python -m pytest -q tests/unit/test_preflight.py -k holding``
"""

from __future__ import annotations

from pathlib import Path

from omnilearn.observe.rundir import RUN_FILES, RunDirError, check_out


def check_new_out(out: str | None, overwrite: bool) -> Path:
    """The run directory ``out`` names (see ``check_out``); one that holds a run is refused naming ``--resume``."""
    try:
        return check_out(out, overwrite)
    except RunDirError:
        path = Path(out) if out is not None else None
        held = [f for f in RUN_FILES if path is not None and (path / f).exists()]
        if not held:
            raise
        if (path / "config.toml").is_file() and (path / "checkpoints").is_dir():
            way = "continue it with --resume (from its newest checkpoint), choose another --out, or pass --overwrite"
        else:
            way = "it has no checkpoint to --resume from; choose another --out or pass --overwrite"
        raise RunDirError(f"--out {str(path)!r} already holds a run ({', '.join(held)}); {way}") from None

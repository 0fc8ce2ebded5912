"""Whether a torchrun worker continues the job whose run directory it opens.

torchrun starts a job's workers again in two ways: after a failure (``TORCHELASTIC_RESTART_COUNT`` goes up:
:func:`restarted`) and when its membership changes (a node joins an elastic ``--nnodes MIN:MAX`` job: the count
stays as it was). A scheduler may also launch the same job again (Slurm's requeue of ``--rdzv-id $SLURM_JOB_ID``).
The job is named by its rendezvous (``TORCHELASTIC_RUN_ID``: torchrun's ``--rdzv-id``; ``--standalone`` makes a
fresh one per launch), which rank 0 writes into the run directory (:func:`mark`); :func:`again` reads it. A
restarted job's record goes on in place (``keep``); one started again without a count is treated as an
``overwrite=True`` re-run of itself: its record is held until the script resumes it or trains without it
(:mod:`omnilearn.observe.heldrun`), so a re-formed job resumes its record and never finds its own run directory
"already holding a run" (which, before, failed the re-formed job once more; with ``omnilearn train --overwrite``
under torchrun the command line cleared it).

No torch. Run: ``python -m pytest -q tests/unit/test_samejob.py``
"""

from __future__ import annotations

import os
from pathlib import Path

MARK = ".torchrun-job"  # in the run directory: the rendezvous id of the job that writes it


def job_id() -> str | None:
    """This torchrun job's rendezvous id, or None outside torchrun (or one without an id)."""
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return run if run not in ("", "none") else None


def restarted() -> bool:
    """Whether torchrun restarted this worker's job after a failure (its restart count is above 0)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0


def again(out: str | Path | None) -> bool:
    """Whether ``out`` is marked by this job's rendezvous id: the job re-formed (a node joined) or launched again."""
    job = job_id()
    if job is None or out is None:
        return False
    try:
        return (Path(out) / MARK).read_text(encoding="utf-8") == job
    except (OSError, UnicodeDecodeError):
        return False


def mark(run_dir: Path) -> None:
    """Rank 0, once it has prepared ``run_dir``: name this job in it (nothing outside torchrun)."""
    from omnilearn.observe.rundir import write_atomic

    job = job_id()
    if job is not None:
        data = job.encode("utf-8")
        write_atomic(run_dir / MARK, lambda f: f.write(data))


def say_again(out: str | Path, what: str) -> None:
    """The one line rank 0 says when ``out`` is taken as this job's own (:func:`again`): never silently."""
    import sys

    print(f"omnilearn: {out} holds the record of this torchrun job (rendezvous {job_id()!r}), re-formed or launched "
          f"again: {what}", file=sys.stderr, flush=True)

"""Resuming and restarting a run: ``--resume``, ``--max-restarts``, torchrun restarts.

- :func:`resumed_run` / :func:`check_resume`: ``--resume`` takes the run's own
  ``config.toml`` (flags override it) and refuses a flag that would change
  what is learned (:data:`RESUME_MAY_CHANGE` lists what may change).
- :func:`run_local_with_restarts`: the local launcher, again from the newest
  checkpoint after a failure, up to ``--max-restarts`` times; the failed
  attempt's error logs move to ``RUN_DIR/failures/attempt-<k>/``. Never after
  a stop signal (:class:`~omnilearn.experiments.launch.local.Interrupted`).
- :func:`torchrun_restart`: whether torchrun restarted (or re-formed: a node
  joined) this rank's job; such a rank resumes the run in ``--out``.

Run: ``python -m pytest -q tests/faults/test_resume.py``
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Callable

from omnilearn.checkpoint import CheckpointStore
from omnilearn.config import ConfigError
from omnilearn.distributed.group import launched_by_torchrun
from omnilearn.experiments.launch import local as launch
from omnilearn.experiments.config import TrainConfig, load_toml
from omnilearn.observe import samejob
from omnilearn.observe.recorder import FAILED_AT_ENV

# What a resumed run may change: how it runs, not what it computes (the weights must follow the same path).
RESUME_MAY_CHANGE = frozenset({
    "workers", "speeds", "speed_schedule", "emulator", "containers", "throttle_cpus", "controller", "deadband",
    "min_batch", "max_batch", "memory", "control_interval", "min_window_s", "device", "timeout_s", "heartbeat_s", "quiet", "loader_workers",
    "checkpoint_every", "keep_checkpoints", "resume", "max_restarts", "oversubscribe", "out", "overwrite",
    "data_dir", "preset", "max_time_s"})


def resumed_run(config: str | None, out: str | None) -> dict:
    """``--resume``: the run's own ``config.toml`` is the config file (flags still override)."""
    if config:
        raise ConfigError("--resume takes its settings from the run's config.toml; drop --config (flags still "
                          "override it)")
    if out is None:
        raise ConfigError("--resume needs --out: the run directory to continue")
    if not (Path(out) / "config.toml").is_file():
        raise ConfigError(f"--resume: {out!r} holds no run (no config.toml); check --out, or start a new run "
                          "without --resume")
    return load_toml(str(Path(out) / "config.toml"))


def check_resume(cfg: TrainConfig, original: TrainConfig) -> None:
    """A resumed run computes what the original did: refuse a changed learning setting, naming it."""
    for name in TrainConfig.__dataclass_fields__:
        if name not in RESUME_MAY_CHANGE and getattr(cfg, name) != getattr(original, name):
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"{flag} {getattr(cfg, name)!r} differs from the run's {getattr(original, name)!r}: a "
                              f"resumed run keeps what it learns with; drop {flag} (or start a new run)")



def run_local_with_restarts(cfg: TrainConfig, run_dir: Path) -> None:
    """Run the local workers; after a failure resume from the newest checkpoint, ``cfg.max_restarts`` times."""
    with_restarts(lambda resume: launch.run_local([launch.Job(dataclasses.replace(cfg, resume=resume), run_dir)],
                                                  run_dir),
                  run_dir, cfg.max_restarts, cfg.resume, "error-rank*.log", lambda: latest_checkpoint(run_dir))


def with_restarts(attempt: Callable[[bool], None], run_dir: Path, max_restarts: int, resume: bool, logs: str,
                  where: Callable[[], str]) -> None:
    """``attempt(resume)``; after a worker failure (never a stop asked for: :class:`~omnilearn.experiments.launch.
    supervise.Interrupted`), again with ``resume=True``, up to ``max_restarts`` times. The failed attempt's logs
    (the ``logs`` pattern in ``run_dir``) move to ``RUN_DIR/failures/attempt-<k>/``; ``where()`` says what the
    restart resumes from. Both launchers' (PyTorch, TensorFlow) restart loop."""
    restarts = 0
    while True:
        try:
            attempt(resume)
            return
        except launch.WorkerFailed as e:
            if restarts >= max_restarts or isinstance(e, launch.Interrupted):
                raise
            restarts, resume = restarts + 1, True
            kept = keep_failure_logs(run_dir, restarts, logs)
            print(f"omnilearn: {e}; restart {restarts} of {max_restarts} from {where()} (logs kept in {kept})",
                  file=sys.stderr, flush=True)
            os.environ[FAILED_AT_ENV] = f"{time.time():.6f}"  # the resumed run reports the time it took


def torchrun_restart(out: str | None) -> bool:
    """Whether torchrun started this job's ranks again: restarted (after a failure), or re-formed (a node joined)
    with a checkpoint to resume in ``out``, the job's run directory (:mod:`omnilearn.observe.samejob`); False
    outside torchrun. Every rank decides this before the group is joined, so the mark alone is not enough: in a
    first launch rank 0 may have made and marked ``out`` before a slower rank looks, which then resumed alone and
    hung the job; a checkpoint cannot exist before every rank has joined."""
    if not launched_by_torchrun():
        return False
    if samejob.restarted():
        return True
    return out is not None and samejob.again(out) and bool(CheckpointStore(Path(out) / "checkpoints").steps())


def keep_failure_logs(run_dir: Path, attempt: int, logs: str = "error-rank*.log") -> Path:
    """Move the failed attempt's logs (``error-rank*.log``, or the ``logs`` pattern) to ``RUN_DIR/failures/attempt-<k>/``."""
    kept = run_dir / "failures" / f"attempt-{attempt}"
    kept.mkdir(parents=True, exist_ok=True)
    for log in run_dir.glob(logs):
        log.replace(kept / log.name)
    return kept


def latest_checkpoint(run_dir: Path) -> str:
    steps = CheckpointStore(run_dir / "checkpoints").steps()
    return f"the checkpoint of step {steps[-1]}" if steps else "the start (no checkpoint yet)"

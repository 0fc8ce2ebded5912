"""Up-front checks of a training run: what the workers would otherwise hit, refused before any starts.

``check(cfg)`` runs, cheapest first, and raises
:class:`~omnilearn.config.ConfigError` (one line naming the value and the
fix) on the first problem; it writes nothing, so the CLI calls it before it
creates the run directory and before any worker starts:

- local oversubscription: more than ``OVERSUBSCRIBE_PER_CORE`` local processes
  (workers, plus the server in ``--mode asp``; ``LOCAL_WORLD_SIZE`` under
  torchrun) per usable core, unless ``--oversubscribe``;
- ``--out``: a directory (or its nearest existing parent) this process may
  write, with at least ``MIN_FREE_BYTES`` free, not holding a run unless
  ``--overwrite`` (the refusal names ``--resume`` too:
  :mod:`omnilearn.experiments.train.newrun`); with ``--resume`` instead a run (``config.toml``) with a
  ``checkpoints/`` directory. Under torchrun only rank 0 writes it, so only
  rank 0 checks it;
- the emulator's OS preconditions
  (:func:`omnilearn.emulation.throttle.preflight`: cores for affinity, a
  writable cgroup tree delegating the cpu controller, docker containers that
  exist and run);
- the data's layout, without loading it (``workload.check`` loads it after):
  CIFAR batch files, a text corpus's files and size, the mnist1d cache, and
  for an image folder its classes plus a decoded sample of images, which the
  workers would otherwise decode only after they started.

Run its tests:  python -m pytest -q tests/unit/test_preflight.py
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from omnilearn.config import ConfigError
from omnilearn.distributed import group
from omnilearn.emulation import throttle
from omnilearn.emulation.speeds import SpeedError, load_schedule, paper_schedule
from omnilearn.experiments.config import TrainConfig
from omnilearn.experiments.datasets import core as data
from omnilearn.experiments.datasets import images, text
from omnilearn.experiments.train.workload import data_spec
from omnilearn.experiments.train.newrun import check_new_out
from omnilearn.observe.rundir import RunDirError, existing_parent, filesystem, size_text

OVERSUBSCRIBE_PER_CORE = 8  # local processes per usable core, beyond which --oversubscribe is needed
MIN_FREE_BYTES = 10 * 10**6  # free space --out needs to start a run


def check(cfg: TrainConfig) -> None:
    """Every check below, cheapest first; the first problem raises :class:`ConfigError`."""
    check_processes(cfg)
    if writes_run_dir(cfg):
        check_out_dir(cfg)
    check_emulator(cfg)
    check_speed_schedule(cfg)
    check_data(cfg)


def check_speed_schedule(cfg: TrainConfig) -> None:
    """A ``--speed-schedule`` reads and fits the workers (before the data and model checks print their lines)."""
    if cfg.speed_schedule is None:
        return
    try:  # the run's length is not known yet: any will do for these checks (epochs read as steps)
        if cfg.speed_schedule == "paper":
            paper_schedule(1000, cfg.workers, cfg.levels)
        else:
            load_schedule(cfg.speed_schedule, cfg.workers, 1, cfg.levels)
    except SpeedError as e:
        raise ConfigError(str(e)) from None


def writes_run_dir(cfg: TrainConfig) -> bool:
    """Whether this process writes ``--out``: the launcher, torchrun's rank 0, or worker 0 of ``TF_CONFIG``."""
    if group.launched_by_torchrun():
        return os.environ.get("RANK") == "0"
    if cfg.framework == "tensorflow" and os.environ.get("TF_CONFIG", "").strip():
        from omnilearn.tf.cluster import from_env  # pure: reads TF_CONFIG, imports no TensorFlow

        return from_env().is_main
    return True


# ---------------------------------------------------------------- processes
def local_processes(cfg: TrainConfig) -> int:
    """Processes this launch starts on this machine: torchrun's ``LOCAL_WORLD_SIZE``, else workers (+ server)."""
    if group.launched_by_torchrun() and "LOCAL_WORLD_SIZE" in os.environ:
        return int(os.environ["LOCAL_WORLD_SIZE"])
    return cfg.workers + (1 if cfg.mode == "asp" else 0)


def check_processes(cfg: TrainConfig) -> None:
    """Refuse more than ``OVERSUBSCRIBE_PER_CORE`` local processes per usable core unless ``cfg.oversubscribe``."""
    n, cores = local_processes(cfg), group.usable_cpus()
    limit = OVERSUBSCRIBE_PER_CORE * cores
    if n <= limit or cfg.oversubscribe:
        return
    where = (f"is {f'{n / cores:.1f}'.removesuffix('.0')} processes per core on this {cores}-core machine "
             f"(limit {OVERSUBSCRIBE_PER_CORE} per core)")
    if group.launched_by_torchrun() and "LOCAL_WORLD_SIZE" in os.environ:
        raise ConfigError(f"LOCAL_WORLD_SIZE {n} (torchrun --nproc-per-node) {where}; use --nproc-per-node "
                          f"{limit} or fewer, or pass --oversubscribe")
    server = 1 if cfg.mode == "asp" else 0
    what = f"--workers {cfg.workers}" + (" plus the parameter server" if server else "")
    raise ConfigError(f"{what} {where}; use --workers {limit - server} or fewer, or pass --oversubscribe")


# ---------------------------------------------------------------- output directory
def check_out_dir(cfg: TrainConfig) -> None:
    """``--out`` can take the run (or, with ``--resume``, holds one to continue), on a disk with room."""
    try:
        path = _resume_dir(cfg.out) if cfg.resume else check_new_out(cfg.out, cfg.overwrite)
    except RunDirError as e:
        raise ConfigError(str(e)) from None
    base = existing_parent(path)
    if not base.is_dir():
        raise ConfigError(f"--out {str(path)!r} cannot be created: {base} is a file; choose another --out")
    if not os.access(base, os.W_OK | os.X_OK):
        raise ConfigError(f"--out {str(path)!r} is not writable: no write permission on {base}; "
                          "choose another --out or fix its permissions")
    try:
        free = shutil.disk_usage(base).free
    except OSError:
        return
    if free < MIN_FREE_BYTES:
        raise ConfigError(f"--out {str(path)!r}: only {size_text(free)} free on {filesystem(base)}, a run needs "
                          f"at least {size_text(MIN_FREE_BYTES)}; free some space or choose another --out")


def _resume_dir(out: str | None) -> Path:
    if out is None:
        raise RunDirError("--resume needs --out: the directory of the run to continue")
    path = Path(out)
    if not path.is_dir():
        raise RunDirError(f"--resume: --out {out!r} is not a directory; pass the directory of the run to continue")
    if not (path / "config.toml").is_file():
        raise RunDirError(f"--resume: --out {out!r} holds no run (no config.toml); pass the run's directory "
                          "as --out, or drop --resume to start a new run")
    if not (path / "checkpoints").is_dir():
        raise RunDirError(f"--resume: {out!r} has no checkpoints/ directory (the run saved none: "
                          "--checkpoint-every 0, or it stopped before its first); drop --resume and start over "
                          "with --overwrite")
    return path


# ---------------------------------------------------------------- emulator
def check_emulator(cfg: TrainConfig) -> None:
    """The OS-level throttles' preconditions (nothing to check for ``delay`` and ``none``)."""
    if cfg.emulator not in throttle.THROTTLES:
        return
    local = int(os.environ.get("LOCAL_WORLD_SIZE", cfg.workers))
    containers = [c.strip() for c in cfg.containers.split(",")] if cfg.containers else []
    try:
        throttle.preflight(cfg.emulator, local, containers)
    except throttle.ThrottleError as e:
        raise ConfigError(str(e)) from None


# ---------------------------------------------------------------- data
def check_data(cfg: TrainConfig) -> None:
    """The dataset's files are where and what the loaders expect; nothing is loaded twice."""
    spec = data_spec(cfg)
    try:
        if spec.name in ("cifar10", "cifar100"):
            images.cifar_root(spec.name, spec.data_dir)
        elif spec.name == "imagefolder":
            images.check_imagefolder(spec.data_dir, spec.image_size, spec.seed)
        elif spec.name == "text":
            text.check_text(spec.data_dir, spec.seq_len)
        elif spec.name == "mnist1d":
            _check_cache(data.mnist1d_cache())
    except data.DataError as e:
        raise ConfigError(str(e)) from None


def _check_cache(cache: Path) -> None:
    """mnist1d is generated once into ``cache``: until it is there, its folder must be writable."""
    if cache.is_file():
        return
    base = existing_parent(cache.parent)
    if not base.is_dir() or not os.access(base, os.W_OK | os.X_OK):
        raise ConfigError(f"mnist1d: cannot write its cache {cache.parent} (no write permission on {base}); "
                          "set OMNILEARN_CACHE to a writable folder")

"""From parsed flags to a :class:`~omnilearn.experiments.config.TrainConfig` (``train`` and ``bench``), and the plots.

Defaults, then a preset, then ``--config FILE.toml`` (or, with ``--resume``, the run's own ``config.toml``),
then flags; under torchrun its ``WORLD_SIZE`` decides the worker count. Bad input raises
:class:`~omnilearn.experiments.config.ConfigError` (one line).

Run: ``python -m pytest -q tests/unit/test_presets.py tests/unit/test_human_output.py``
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from omnilearn.distributed.group import device_problem, launched_by_torchrun, torchrun_world_size
from omnilearn.emulation.speeds import speed_count
from omnilearn.experiments.config import (ASP_DEFAULTS, LANGUAGE_MODEL_DEFAULTS, ConfigError, TrainConfig, build,
                                          load_toml, workers_from_speeds)
from omnilearn.experiments.presets import load_preset
from omnilearn.experiments.train import restarts
from omnilearn.experiments.zoo.models import is_language_model

NOT_CONFIG = ("command", "config", "plots", "quick", "repeats", "target_accuracy", "path", "tensorboard", "steps",
              "block_steps")


def config_from_args(args: argparse.Namespace, **overrides) -> TrainConfig:
    values = {k: v for k, v in vars(args).items() if k not in NOT_CONFIG}
    values.update(overrides)
    resumed = None
    if values.get("resume"):
        resumed = restarts.resumed_run(getattr(args, "config", None), getattr(args, "out", None))
    if resumed is not None and values.get("workers", resumed.get("workers")) != resumed.get("workers"):
        if "speeds" not in values:
            resumed.pop("speeds", None)  # the old run's speeds were for its worker count
    file_values = resumed if resumed is not None else load_toml(args.config) if getattr(args, "config", None) else {}
    preset = values.get("preset", file_values.get("preset"))
    if preset is not None:
        preset_values = load_preset(preset)
        if launched_by_torchrun():
            preset_values.pop("workers", None)  # torchrun's world size decides
        file_values = {**preset_values, **file_values, "preset": preset_values["preset"]}
        values.pop("preset", None)
    if not launched_by_torchrun():  # torchrun's WORLD_SIZE decides: _torchrun_workers
        workers_from_speeds(values, file_values)
    merged = {**file_values, **values}
    if merged.get("lr_schedule", TrainConfig.lr_schedule) != "multistep" and "milestones" not in values:
        file_values.pop("milestones", None)  # a preset's milestones do not outlive its schedule
    if is_language_model(merged.get("model", TrainConfig.model)):
        file_values = {**LANGUAGE_MODEL_DEFAULTS, **file_values}
    if merged.get("speeds") is not None and merged.get("speed_schedule") is not None:
        raise ConfigError("--speeds and --speed-schedule both given; the schedule sets the speeds, drop --speeds")
    schedule = merged.get("speed_schedule")
    if isinstance(schedule, str) and schedule != "paper":
        values["speed_schedule"] = os.path.abspath(schedule)  # config.toml repeats the run from anywhere
    if launched_by_torchrun():
        values["workers"] = torchrun_workers(values, file_values)
    if values.get("mode", file_values.get("mode")) == "asp":
        file_values = {**ASP_DEFAULTS, **file_values}
    cfg = build(file_values, values)
    if resumed is not None:
        restarts.check_resume(cfg, build(resumed, {}))
    local_workers = int(os.environ.get("LOCAL_WORLD_SIZE", cfg.workers))
    problem = device_problem(cfg.device, local_workers)
    if problem:
        raise ConfigError(problem)
    if cfg.emulator in ("cgroup", "affinity", "docker"):
        from omnilearn.emulation.throttle import ThrottleError, preflight

        try:
            preflight(cfg.emulator, local_workers)
        except ThrottleError as e:
            raise ConfigError(str(e)) from None
    if cfg.framework == "pytorch":
        check_torch(f"omnilearn {getattr(args, 'command', None) or 'train'}")
    return cfg


def check_torch(door: str) -> None:
    """The torch check of every PyTorch door (:func:`omnilearn.torchnames.require_torch`), its warning one
    ``omnilearn: warning: ...`` line; a refusal is a ConfigError (one ``omnilearn: error:`` line, exit 2)."""
    import warnings

    from omnilearn.torchnames import require_torch

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        require_torch(door=door)
    for warning in said:
        print(f"omnilearn: warning: {warning.message}", file=sys.stderr, flush=True)


def torchrun_workers(values: dict, file_values: dict) -> int:
    """Workers under torchrun: WORLD_SIZE, less the parameter server in ASP."""
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise ConfigError(f"RANK and WORLD_SIZE are set but {' and '.join(missing)} not: launch with torchrun, "
                          "or export the address and port of rank 0 (the server in --mode asp)")
    asp = values.get("mode", file_values.get("mode")) == "asp"
    world = torchrun_world_size()
    workers = world - 1 if asp else world
    if workers < 1:
        raise ConfigError(f"--mode asp needs a server and at least one worker: WORLD_SIZE {world} is too small; "
                          "use --nproc-per-node 2 or more")
    given = values.get("workers", file_values.get("workers"))
    if given is not None and given != workers:
        raise ConfigError(f"--workers {given} does not match torchrun's WORLD_SIZE {world}"
                          f"{' (one is the server)' if asp else ''}; drop --workers")
    typed = speed_count(values.get("speeds"))
    if typed is not None and typed != workers:
        raise ConfigError(f"--speeds {values['speeds']} gives {typed} workers but torchrun's WORLD_SIZE {world} "
                          f"gives {workers}{' (one is the server)' if asp else ''}; give one speed per worker")
    return workers


def write_plots(path: Path) -> None:
    from omnilearn.experiments.report.records import ReportError
    from omnilearn.experiments.report.runs import render

    try:
        files = render(path)
    except ReportError as e:  # the run itself succeeded; say why there is no picture
        print(f"omnilearn: plots skipped: {e}", file=sys.stderr)
        return
    print(f"plots: {', '.join(str(f) for f in files)}")

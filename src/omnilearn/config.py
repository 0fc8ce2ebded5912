"""Training configuration: a frozen dataclass validated on construction.

Values come from defaults, then an optional TOML file (``--config``; keys are
the field names below, dashes or underscores), then explicit CLI flags. The
resolved config is written to ``RUN_DIR/config.toml`` and can be fed back
with ``--config`` to repeat a run.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, fields
from typing import Any, Mapping

from omnilearn.allocation import InfeasibleBounds, check_feasible
from omnilearn.controller import CONTROLLERS
from omnilearn.data import DATASETS
from omnilearn.models import MODELS
from omnilearn.speeds import BSP_LEVELS, SpeedError, parse_speeds
from omnilearn.tomlfile import read_toml


class ConfigError(ValueError):
    """A user-facing configuration mistake; the message names the value and the fix."""


MAX_TIMEOUT_S = 7 * 24 * 3600.0
EMULATORS = ("delay", "cgroup", "affinity", "docker", "none")
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class TrainConfig:
    workers: int = 4
    model: str = "cnn1d"
    dataset: str = "mnist1d"
    global_batch: int = 512
    epochs: int = 40
    max_steps: int | None = None
    lr: float = 0.05
    momentum: float = 0.9
    seed: int = 0
    speeds: str | None = None  # None: HL8 for 4 workers, equal speeds otherwise
    speed_schedule: str | None = None  # "paper" or a TOML file
    emulator: str = "delay"
    containers: str | None = None  # --emulator docker: one container name per worker, comma-separated
    throttle_cpus: float | None = None  # cgroup/docker: CPUs of the fastest worker (None: cores / workers)
    controller: str = "omnilearn"
    deadband: float = 0.05
    min_batch: int = 8
    max_batch: int | None = None  # None: the global batch
    control_interval: int = 15
    out: str | None = None  # None: runs/<timestamp>
    overwrite: bool = False
    device: str = "auto"
    loader_workers: int = 0
    timeout_s: float = 300.0
    quiet: bool = False  # one line per run instead of live progress (used by bench)

    def __post_init__(self) -> None:
        _check_types(self)
        if self.speeds is None:
            object.__setattr__(self, "speeds", "HL8" if self.workers == 4 else ",".join(["1"] * self.workers))
        _positive(self, "workers", "global_batch", "epochs", "lr", "control_interval", "timeout_s")
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError(f"--max-steps {self.max_steps} must be at least 1 (or omit it to run --epochs)")
        if not 0 <= self.seed < 2**63:
            raise ConfigError(f"--seed {self.seed} must be in [0, 2**63)")
        if self.timeout_s > MAX_TIMEOUT_S:
            raise ConfigError(f"--timeout-s {self.timeout_s:g} is too long; use at most {MAX_TIMEOUT_S:g} seconds")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"--momentum {self.momentum} must be in [0, 1)")
        if not 0 <= self.deadband < 1:
            raise ConfigError(f"--deadband {self.deadband} must be in [0, 1), e.g. 0.05")
        names = [c.strip() for c in self.containers.split(",")] if self.containers else []
        if self.emulator == "docker" and (len(names) != self.workers or not all(names)):
            raise ConfigError(f"--emulator docker needs --containers with one name per worker ({self.workers}), "
                              f"got {self.containers!r}")
        if self.containers is not None and self.emulator != "docker":
            raise ConfigError("--containers is only used with --emulator docker")
        if self.throttle_cpus is not None and self.emulator not in ("cgroup", "docker"):
            raise ConfigError("--throttle-cpus is only used with --emulator cgroup or docker")
        if self.throttle_cpus is not None and self.throttle_cpus <= 0:
            raise ConfigError(f"--throttle-cpus {self.throttle_cpus:g} must be positive")
        if self.loader_workers < 0:
            raise ConfigError(f"--loader-workers {self.loader_workers} must be 0 or more")
        for name, allowed in (("model", MODELS), ("dataset", DATASETS), ("controller", CONTROLLERS),
                              ("emulator", EMULATORS), ("device", DEVICES)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"unknown {name} {getattr(self, name)!r}; choose one of {', '.join(allowed)}")
        try:
            check_feasible(self.global_batch, self.workers, self.min_batch, self.upper_batch)
            parse_speeds(self.speeds, self.workers, BSP_LEVELS)
        except (InfeasibleBounds, SpeedError) as e:
            raise ConfigError(str(e)) from None

    @property
    def upper_batch(self) -> int:
        return self.global_batch if self.max_batch is None else self.max_batch

    @property
    def declared_speeds(self) -> tuple[float, ...]:
        return parse_speeds(self.speeds, self.workers, BSP_LEVELS)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check_types(cfg: TrainConfig) -> None:
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        kinds = _KINDS[f.name]
        if value is None and "None" in str(f.type):
            continue
        if isinstance(value, bool) and bool not in kinds:
            raise ConfigError(f"{f.name} = {value!r} must be a {kinds[0].__name__}")
        if not isinstance(value, kinds):
            raise ConfigError(f"{f.name} = {value!r} must be a {kinds[0].__name__}")
        if float in kinds and not math.isfinite(value):
            raise ConfigError(f"{f.name} = {value!r} must be a finite number")
        if float in kinds and isinstance(value, int):
            object.__setattr__(cfg, f.name, float(value))


_KINDS: dict[str, tuple[type, ...]] = {
    f.name: (bool,) if f.type == "bool" else (float, int) if "float" in str(f.type)
    else (int,) if "int" in str(f.type) else (str,)
    for f in fields(TrainConfig)
}


def _positive(cfg: TrainConfig, *names: str) -> None:
    for name in names:
        if getattr(cfg, name) <= 0:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"{flag} {getattr(cfg, name)} must be positive")


def normalise_keys(values: Mapping[str, Any], source: str) -> dict[str, Any]:
    """Map ``global-batch`` to ``global_batch`` and reject unknown keys."""
    known = {f.name for f in fields(TrainConfig)}
    out = {}
    for key, value in values.items():
        name = key.replace("-", "_")
        if name not in known:
            raise ConfigError(f"unknown setting {key!r} in {source}; known: {', '.join(sorted(known))}")
        out[name] = value
    return out


def load_toml(path: str) -> dict[str, Any]:
    """Read a config file; a ``[train]`` table or top-level keys both work."""
    doc = read_toml(path, "config file", ConfigError)
    table = doc.get("train", doc)
    if not isinstance(table, dict):
        raise ConfigError(f"config file {path!r}: [train] must be a table of settings")
    return normalise_keys(table, path)


def build(file_values: Mapping[str, Any], cli_values: Mapping[str, Any]) -> TrainConfig:
    """Defaults < config file < CLI flags."""
    try:
        return TrainConfig(**{**file_values, **cli_values})
    except TypeError as e:  # pragma: no cover - keys are normalised before
        raise ConfigError(str(e)) from None


def dump_toml(cfg: TrainConfig) -> str:
    """The resolved config as TOML (``None`` values are left out)."""
    lines = ["# Resolved OmniLearn config; rerun with: omnilearn train --config config.toml", "[train]"]
    for key, value in cfg.to_dict().items():
        if value is not None and key not in ("out", "overwrite"):
            lines.append(f"{key} = {json.dumps(value)}")
    return "\n".join(lines) + "\n"

"""Balancing settings: :class:`BalanceConfig`, a frozen dataclass validated on construction.

Values come from defaults, then an optional TOML file (``--config``; keys are
the field names below, dashes or underscores), then explicit CLI flags. The
resolved config is written to ``RUN_DIR/config.toml`` and can be fed back
with ``--config`` to repeat a run.

:func:`shared_settings` is what every rank must agree on (the session checks
it across ranks at start): everything but host-local values such as paths
(``out``, ``data_dir``), the device and console settings; a speed-schedule
file counts by its content, not its path, so nodes may mount it anywhere.

``max_batch`` (the largest batch a worker may get, its memory cap): one
number for every worker, one per worker (a list or tuple, in TOML an array,
on the command line ``256,64,64,64``; stored as a tuple), ``"auto"`` (on
CUDA each rank measures its first step's memory and caps itself:
:mod:`omnilearn.bsp.memory`), or None (no cap beyond the global batch).
:attr:`BalanceConfig.batch_caps` is the form the planner takes. ``memory``: each rank's memory, caps counted from it
(:mod:`omnilearn.balance.memplan`).

Run: ``python -m pytest -q tests/unit/test_session_state.py tests/unit/test_cli_errors.py``
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar, Mapping

from omnilearn.balance.allocation import InfeasibleBounds, check_feasible
from omnilearn.balance.controllers import CONTROLLERS
from omnilearn.balance.memplan import PlanError, parse_memory
from omnilearn.emulation.speeds import BSP_LEVELS, SpeedError, parse_speeds


class ConfigError(ValueError):
    """A user-facing configuration mistake; the message names the value and the fix."""


MAX_TIMEOUT_S = 7 * 24 * 3600.0
EMULATORS = ("delay", "cgroup", "affinity", "docker", "none")
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class BalanceConfig:
    """How batches are balanced: everything the Python API (:func:`omnilearn.setup`) needs.

    ``workers`` is the number of worker processes; the API fills it from the
    process group. The CLI's :class:`TrainConfig` adds the workload.
    """

    workers: int | None = None
    global_batch: int = 512
    seed: int = 0
    speeds: str | None = None  # emulated relative speeds; None: all equal (no emulation)
    speed_schedule: str | None = None  # "paper" or a TOML file
    emulator: str = "delay"
    containers: str | None = None  # --emulator docker: one container name per worker, comma-separated
    throttle_cpus: float | None = None  # cgroup/docker: CPUs of the fastest worker (None: cores / workers)
    controller: str = "model"  # the bench of 2026-11-23: same step time as "omnilearn", settles faster
    deadband: float = 0.05
    min_batch: int | None = None  # None: derived from the per-worker batch (:func:`derive_min_batch`)
    max_batch: int | tuple[int, ...] | str | None = None  # one, one per worker, "auto" (CUDA probe); None: none
    memory: int | tuple[int, ...] | str | None = None  # bytes, one or per worker, "auto" (CUDA): balance/memplan.py
    batch_multiple: int = 1  # adaptive batches in multiples of this (fewer shapes: fewer torch.compile recompiles)
    control_interval: int = 15
    min_window_s: float = 0.15  # a window shorter than this is stretched to whole intervals (0: never)
    accumulation_steps: int = 1  # micro-batches per optimizer step on every worker (gradient accumulation)
    out: str | None = None  # run directory (CLI default: runs/<timestamp>; API default: none written)
    overwrite: bool = False
    device: str = "auto"
    timeout_s: float = 300.0
    heartbeat_s: float = 60.0  # a rank whose heartbeat stops this long is reported as hung (distributed/watchdog.py)
    quiet: bool = False  # one line per run instead of live progress (used by bench)

    # Settings that may differ between ranks: host paths (``data_dir`` and ``preset``, a preset file's path, are
    # the harness's), the device, console output.
    host_local: ClassVar[frozenset[str]] = frozenset({"out", "overwrite", "device", "timeout_s", "heartbeat_s",
                                                      "quiet"})

    def __post_init__(self) -> None:
        object.__setattr__(self, "max_batch", parse_max_batch(self.max_batch))
        try:
            object.__setattr__(self, "memory", parse_memory(self.memory))
        except PlanError as e:
            raise ConfigError(str(e)) from None
        _check_types(self)
        if self.workers is not None and self.workers < 1:
            raise ConfigError(f"--workers {self.workers} must be positive")
        if self.speeds is None and self.workers is not None:
            object.__setattr__(self, "speeds", ",".join(["1"] * self.workers))
        check_positive(self, "global_batch", "control_interval", "timeout_s", "heartbeat_s", "accumulation_steps",
                       "batch_multiple")
        if self.min_batch is None and self.workers is not None:
            object.__setattr__(self, "min_batch", derive_min_batch(self.global_batch, self.workers,
                                                                   self.accumulation_steps, self.batch_caps))
        if self.workers is not None and self.global_batch < self.workers * self.accumulation_steps:
            raise ConfigError(f"--accumulation-steps {self.accumulation_steps} needs {self.accumulation_steps} samples "
                              f"per worker, but --global-batch {self.global_batch} over {self.workers} workers gives "
                              f"{self.global_batch // self.workers}; raise --global-batch or lower --accumulation-steps")
        if self.min_batch is not None and self.min_batch < 1:
            raise ConfigError(f"--min-batch {self.min_batch} must be positive")
        if self.min_batch is not None and self.min_batch < self.accumulation_steps:
            raise ConfigError(f"--min-batch {self.min_batch} is below --accumulation-steps {self.accumulation_steps}: "
                              f"each worker's batch is split into {self.accumulation_steps} micro-batches and none may "
                              f"be empty; use --min-batch {self.accumulation_steps} or more")
        if not 0 <= self.seed < 2**63:
            raise ConfigError(f"--seed {self.seed} must be in [0, 2**63)")
        if self.heartbeat_s > MAX_TIMEOUT_S:
            raise ConfigError(f"--heartbeat-s {self.heartbeat_s:g} is too long; use at most {MAX_TIMEOUT_S:g} seconds")
        if self.timeout_s > MAX_TIMEOUT_S:
            raise ConfigError(f"--timeout-s {self.timeout_s:g} is too long; use at most {MAX_TIMEOUT_S:g} seconds")
        if not 0 <= self.min_window_s <= MAX_TIMEOUT_S:
            raise ConfigError(f"--min-window-s {self.min_window_s:g} must be in [0, {MAX_TIMEOUT_S:g}] seconds, e.g. "
                              "0.15 (0: a meeting at every interval's end, however short)")
        if not 0 <= self.deadband < 1:
            raise ConfigError(f"--deadband {self.deadband} must be in [0, 1), e.g. 0.05")
        self._check_emulator()
        for name, allowed in (("controller", CONTROLLERS), ("emulator", EMULATORS), ("device", DEVICES)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"unknown {name} {getattr(self, name)!r}; choose one of {', '.join(allowed)}")
        if self.workers is not None:
            check_caps(self.max_batch, self.workers, self.min_batch)
            try:
                check_feasible(self.global_batch, self.workers, self.min_batch, self.batch_caps or self.global_batch)
                parse_speeds(self.speeds, self.workers, self.levels)
            except (InfeasibleBounds, SpeedError) as e:
                raise ConfigError(str(e)) from None

    def _check_emulator(self) -> None:
        names = [c.strip() for c in self.containers.split(",")] if self.containers else []
        if self.emulator == "docker" and ((self.workers is not None and len(names) != self.workers) or not all(names)
                                          or not names):
            raise ConfigError(f"--emulator docker needs --containers with one name per worker ({self.workers}), "
                              f"got {self.containers!r}")
        if self.containers is not None and self.emulator != "docker":
            raise ConfigError("--containers is only used with --emulator docker")
        if self.throttle_cpus is not None and self.emulator not in ("cgroup", "docker"):
            raise ConfigError("--throttle-cpus is only used with --emulator cgroup or docker")
        if self.throttle_cpus is not None and self.throttle_cpus <= 0:
            raise ConfigError(f"--throttle-cpus {self.throttle_cpus:g} must be positive")

    @property
    def upper_batch(self) -> int:
        """The largest batch any worker may get (per-worker caps: the largest of them)."""
        caps = self.batch_caps
        return self.global_batch if caps is None else max(caps) if isinstance(caps, tuple) else caps

    @property
    def batch_caps(self) -> int | tuple[int, ...] | None:
        """``max_batch`` as the planner takes it (:class:`~omnilearn.balance.allocation.Bounds`): "auto" is None."""
        return None if self.max_batch == AUTO else self.max_batch

    @property
    def levels(self) -> dict[str, tuple[float, ...]]:
        """What HL1..HL8 mean: the paper's BSP table."""
        return BSP_LEVELS

    @property
    def declared_speeds(self) -> tuple[float, ...]:
        if self.workers is None:
            raise ValueError("the number of workers is not known yet")
        return parse_speeds(self.speeds, self.workers, self.levels)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


AUTO = "auto"  # max_batch: each rank probes its memory (CUDA)
MIN_BATCH_CEILING = 8  # the derived min_batch never exceeds this


def derive_min_batch(global_batch: int, workers: int, accumulation_steps: int = 1,
                     caps: int | tuple[int, ...] | None = None) -> int:
    """``min_batch`` when none is given: a quarter of the even share, at most 8, at least 1 per micro-batch.

    So the controller can always move (an even share of 8 gets a floor of 2,
    not 8: a fixed floor of 8 froze 8/8 splits), and a tiny batch never
    wastes a large machine. Per-worker caps below it lower it.
    """
    share = max(1, global_batch // max(1, workers))
    floor = max(accumulation_steps, min(MIN_BATCH_CEILING, max(1, share // 4)))
    if caps is not None:
        floor = min(floor, max(accumulation_steps, min(caps) if isinstance(caps, tuple) else caps))
    return floor


def parse_max_batch(value: Any) -> int | tuple[int, ...] | str | None:
    """``max_batch`` in any accepted form (int, "256", "256,64,64,64", a list, "auto") as int, tuple, "auto" or None."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    said = ",".join(str(v) for v in value) if isinstance(value, (list, tuple)) else repr(value)
    parts: Any = value
    if isinstance(value, str):
        if value.strip().lower() == AUTO:
            return AUTO
        parts = value.split(",")
        try:
            parts = [int(p.strip()) for p in parts]
        except ValueError:
            parts = None
    if not isinstance(parts, (list, tuple)) or not parts or not all(
            isinstance(c, int) and not isinstance(c, bool) for c in parts):
        raise ConfigError(f"--max-batch {said} must be one number, one per worker separated by commas "
                          f"(e.g. 256,64,64,64) or auto")
    if any(c < 1 for c in parts):
        raise ConfigError(f"--max-batch {said} must be positive")
    return parts[0] if isinstance(value, str) and len(parts) == 1 else tuple(parts)


def check_caps(max_batch: int | tuple[int, ...] | str | None, workers: int, min_batch: int) -> None:
    """Per-worker caps: one per worker, none below ``min_batch`` (their sum is checked with the global batch)."""
    if not isinstance(max_batch, tuple):
        return
    said = ",".join(map(str, max_batch))
    if len(max_batch) != workers:
        raise ConfigError(f"--max-batch {said} gives {len(max_batch)} caps for {workers} workers; give one number "
                          f"or one per worker")
    low = [i for i, c in enumerate(max_batch) if c < min_batch]
    if low:
        raise ConfigError(f"--max-batch {said}: worker {low[0]}'s cap {max_batch[low[0]]} is below --min-batch "
                          f"{min_batch}; raise it or lower --min-batch")


def _check_types(cfg: BalanceConfig) -> None:
    for f in fields(cfg):
        if f.name in ("max_batch", "memory"):  # parse_max_batch and parse_memory checked them
            continue
        value = getattr(cfg, f.name)
        kinds = _kinds(f)
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


def _kinds(f: dataclasses.Field) -> tuple[type, ...]:
    kind = str(f.type)
    return (bool,) if kind == "bool" else (float, int) if "float" in kind else (int,) if "int" in kind else (str,)


_NOT_VALUES = frozenset("a an and at below above by for from in is must needs of on only or per than the to too "
                        "was were with".split())
_FLAG = re.compile(r"--([a-z][a-z0-9-]*)(?:[ =]([^\s;()]+))?")


def api_wording(message: str, keywords: frozenset[str] | None = None) -> str:
    """A message written with CLI flags (``--min-batch 8``) in Python keywords (``min_batch=8``).

    The Python API's errors name what its user typed; flags that are not
    keywords (``keywords``: the config's fields by default) stay as they are.
    """
    known = keywords if keywords is not None else frozenset(f.name for f in fields(BalanceConfig))

    def word(m: re.Match) -> str:
        name = m.group(1).replace("-", "_")
        if name not in known:
            return m.group(0)
        value = m.group(2)
        if value is None or value in _NOT_VALUES:
            return name + m.group(0)[len(m.group(1)) + 2:]
        tail = value[len(value.rstrip(",.:")):]
        return f"{name}={value[:len(value) - len(tail)]}{tail}"

    return _FLAG.sub(word, message)


def check_positive(cfg: BalanceConfig, *names: str) -> None:
    for name in names:
        if getattr(cfg, name) <= 0:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"{flag} {getattr(cfg, name)} must be positive")


def shared_settings(cfg: BalanceConfig) -> dict[str, Any]:
    """The settings every rank must share: all fields but :attr:`BalanceConfig.host_local` ones.

    A speed-schedule file is represented by a hash of its content (its path
    may differ between nodes); an unreadable file by its name only (loading
    it reports the problem).
    """
    out = {k: v for k, v in cfg.to_dict().items() if k not in cfg.host_local}
    schedule = out.get("speed_schedule")
    if schedule is not None and schedule != "paper":
        try:
            out["speed_schedule"] = "sha256:" + hashlib.sha256(Path(schedule).read_bytes()).hexdigest()
        except OSError:
            out["speed_schedule"] = "unreadable:" + Path(schedule).name
    return out


def dump_toml(cfg: BalanceConfig) -> str:
    """The resolved config as TOML (``None`` values are left out)."""
    lines = ["# Resolved OmniLearn config; rerun with: omnilearn train --config config.toml", "[train]"]
    for key, value in cfg.to_dict().items():
        if value is not None and key not in ("out", "overwrite"):
            lines.append(f"{key} = {json.dumps(value)}")
    return "\n".join(lines) + "\n"

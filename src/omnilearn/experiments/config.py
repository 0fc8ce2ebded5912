"""``omnilearn train``'s settings: :class:`TrainConfig` = the balancing settings plus the workload.

Values come from defaults, then a preset, then an optional TOML file
(``--config``; keys are the field names, dashes or underscores), then
explicit CLI flags. The resolved config is written to
``RUN_DIR/config.toml`` and can be fed back with ``--config``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar, Mapping

from omnilearn.asp.rules import LR_SCALINGS
from omnilearn.config import AUTO, DEVICES, EMULATORS, BalanceConfig, ConfigError, check_positive, dump_toml
from omnilearn.emulation.speeds import ASP_LEVELS, BSP_LEVELS, speed_count
from omnilearn.experiments.catalog import DATASETS, LANGUAGE_MODELS, MODELS, is_language_model
from omnilearn.tomlfile import read_toml

__all__ = ["ASP_DEFAULTS", "DEVICES", "EMULATORS", "FRAMEWORKS", "LANGUAGE_MODEL_DEFAULTS", "LR_SCHEDULES", "MODES", "OPTIMIZERS",
           "ConfigError", "TrainConfig", "build", "dump_toml", "load_toml", "normalise_keys", "workers_from_speeds"]

OPTIMIZERS = ("sgd", "adamw")
# What the CLI starts from for a language model, under a preset, --config and flags: a CPU-friendly run.
# What the CLI starts from in --mode asp: plain SGD on the server (with staleness ~n-1, server momentum 0.9
# made balanced runs diverge here), at the rate of one push of B/n samples; the proportional controller
# (the ASP server's windows of a few pushes are noisy for the model's fit, which BSP's bench chose).
ASP_DEFAULTS = {"momentum": 0.0, "lr": 0.05, "controller": "omnilearn"}
LANGUAGE_MODEL_DEFAULTS = {"dataset": "text", "optimizer": "adamw", "lr": 3e-3, "global_batch": 128, "epochs": 1}
LR_SCHEDULES = ("cosine", "multistep", "constant")
MODES = ("bsp", "asp")
FRAMEWORKS = ("pytorch", "tensorflow")


@dataclass(frozen=True)
class TrainConfig(BalanceConfig):
    """``omnilearn train``: the balancing settings plus the workload (model, data, optimizer, schedule)."""

    host_local: ClassVar[frozenset[str]] = BalanceConfig.host_local | {"data_dir", "preset", "resume", "max_restarts",
                                                                       "oversubscribe"}  # may differ per node

    workers: int = 4
    preset: str | None = None  # the paper preset this config started from (informational)
    model: str = "cnn1d"
    dataset: str = "mnist1d"
    data_dir: str | None = None  # cifar10/cifar100/imagefolder: the data on disk; text: a file or folder
    input_shape: str | None = None  # synthetic only, e.g. "3x32x32" (default 40)
    num_classes: int | None = None  # synthetic only (default 10)
    image_size: int = 32  # imagefolder: images are resized to this square
    seq_len: int = 64  # text: tokens (bytes) per sample
    augment: bool = True  # image datasets: random crop + flip on the training split
    epochs: int = 40
    max_steps: int | None = None
    optimizer: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 0.0
    lr_schedule: str = "cosine"
    milestones: str | None = None  # multistep: epochs at which the rate is multiplied by gamma, e.g. "15,30,45"
    gamma: float = 0.1
    loader_workers: int = 0
    mode: str = "bsp"  # bsp: synchronous, DDP; asp: asynchronous, a parameter server besides the workers
    framework: str = "pytorch"  # or tensorflow: Keras on tf.distribute (omnilearn.tf), BSP, the default workload
    lr_scaling: str = "linear"  # asp: each push's rate times b_i / (B / n), or "none"
    staleness_lr: bool = False  # asp: also divide each push's rate by its staleness
    max_staleness: int | None = None  # asp: refuse a push older than this many versions, once per batch (recomputed)
    max_time_s: float | None = None  # asp: stop after this much training time (the bench's equal budget)
    checkpoint_every: int = 500  # steps between checkpoints in RUN_DIR/checkpoints (asp: steps x workers pushes); 0: none
    keep_checkpoints: int = 3  # the newest K checkpoints are kept
    resume: bool = False  # continue the run in --out from its latest checkpoint (metrics are appended)
    max_restarts: int = 0  # local runs: restart the workers from the latest checkpoint after a failure, this often
    oversubscribe: bool = False  # allow more than OVERSUBSCRIBE_PER_CORE local processes per core

    def __post_init__(self) -> None:
        if self.speeds is None and isinstance(self.workers, int):
            object.__setattr__(self, "speeds", "HL8" if self.workers == 4 else None)
        if self.mode not in MODES:
            raise ConfigError(f"unknown mode {self.mode!r}; choose one of {', '.join(MODES)}")
        if self.framework not in FRAMEWORKS:
            raise ConfigError(f"unknown framework {self.framework!r}; choose one of {', '.join(FRAMEWORKS)}")
        super().__post_init__()
        self._check_asp()
        check_positive(self, "epochs", "lr", "image_size", "seq_len")
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError(f"--max-steps {self.max_steps} must be at least 1 (or omit it to run --epochs)")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"--momentum {self.momentum} must be in [0, 1)")
        if self.weight_decay < 0:
            raise ConfigError(f"--weight-decay {self.weight_decay} must be 0 or more")
        if not 0 < self.gamma <= 1:
            raise ConfigError(f"--gamma {self.gamma} must be in (0, 1], e.g. 0.1")
        for name in ("checkpoint_every", "max_restarts"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name.replace('_', '-')} {getattr(self, name)} must be 0 or more")
        if self.keep_checkpoints < 1:
            raise ConfigError(f"--keep-checkpoints {self.keep_checkpoints} must be at least 1")
        if self.loader_workers < 0:
            raise ConfigError(f"--loader-workers {self.loader_workers} must be 0 or more")
        for name, allowed in (("model", MODELS), ("dataset", DATASETS), ("optimizer", OPTIMIZERS),
                              ("lr_schedule", LR_SCHEDULES)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"unknown {name} {getattr(self, name)!r}; choose one of {', '.join(allowed)}")
        self.milestone_epochs  # validates
        self.sample_shape  # validates
        if self.num_classes is not None and self.num_classes < 2:
            raise ConfigError(f"--num-classes {self.num_classes} must be at least 2")
        if is_language_model(self.model) != (self.dataset == "text"):
            raise ConfigError(f"--model {self.model} and --dataset {self.dataset} do not fit: language models "
                              f"({', '.join(LANGUAGE_MODELS)}) train on --dataset text, and only they do")
        if (self.input_shape is not None or self.num_classes is not None) and self.dataset != "synthetic":
            raise ConfigError(f"--input-shape and --num-classes describe --dataset synthetic; drop them for "
                              f"--dataset {self.dataset}")
        self._check_tensorflow()  # last: a misspelt name is named as such first

    @property
    def levels(self) -> dict[str, tuple[float, ...]]:
        """HL1..HL8 from the paper's BSP or ASP table, by mode (ASP's server is not counted)."""
        return ASP_LEVELS if self.mode == "asp" else BSP_LEVELS

    def _check_asp(self) -> None:
        if self.lr_scaling not in LR_SCALINGS:
            raise ConfigError(f"unknown lr_scaling {self.lr_scaling!r}; choose one of {', '.join(LR_SCALINGS)}")
        if self.mode == "bsp":
            for name, default in (("lr_scaling", "linear"), ("staleness_lr", False), ("max_time_s", None),
                                  ("max_staleness", None)):
                if getattr(self, name) != default:
                    raise ConfigError(f"--{name.replace('_', '-')} is only used with --mode asp")
            return
        if self.min_window_s != BalanceConfig.min_window_s:
            raise ConfigError(f"--min-window-s {self.min_window_s:g} is for --mode bsp (its window meetings); "
                              "asp decides every --control-interval x workers pushes: drop it")
        if self.emulator not in ("delay", "none"):
            raise ConfigError(f"--mode asp emulates speeds with --emulator delay or none, not {self.emulator}")
        if self.loader_workers:
            raise ConfigError("--mode asp workers read their batches directly; drop --loader-workers")
        if self.accumulation_steps != 1:
            raise ConfigError(f"--accumulation-steps {self.accumulation_steps} is for --mode bsp; in asp every push "
                              "is one batch: drop it")
        if self.max_time_s is not None and self.max_time_s <= 0:
            raise ConfigError(f"--max-time-s {self.max_time_s:g} must be positive")
        if self.max_staleness is not None and self.max_staleness < 1:
            raise ConfigError(f"--max-staleness {self.max_staleness} must be 1 or more versions (leave it out for no "
                              "bound)")
        if self.max_batch == AUTO or self.memory is not None:
            flag = "--max-batch auto (a CUDA memory probe per rank)" if self.max_batch == AUTO else "--memory"
            raise ConfigError(f"{flag} is for --mode bsp; give --max-batch <samples> in asp")
        if isinstance(self.max_batch, tuple):  # the server plans with one cap for every live worker
            if len(set(self.max_batch)) > 1:
                raise ConfigError(f"--mode asp keeps one cap for every worker; --max-batch "
                                  f"{','.join(map(str, self.max_batch))} differs per worker: give one number")
            object.__setattr__(self, "max_batch", self.max_batch[0])

    def _check_tensorflow(self) -> None:
        """What ``--framework tensorflow`` (:mod:`omnilearn.tf`; ASP: :mod:`omnilearn.tf.asp`) does not have yet."""
        if self.framework != "tensorflow":
            return
        if self.model not in ("cnn1d", "mlp") or self.dataset != "mnist1d":
            raise ConfigError(f"--framework tensorflow trains --model cnn1d or mlp on --dataset mnist1d (got "
                              f"{self.model} on {self.dataset}); for your own Keras model use omnilearn.tf "
                              "(docs/tensorflow.md)")
        if self.mode == "asp":
            asp_missing = {"--resume": self.resume, "--max-restarts": self.max_restarts,
                           "--speed-schedule": self.speed_schedule}
            said = [flag for flag, asked in asp_missing.items() if asked]
            if said:
                raise ConfigError(f"--framework tensorflow --mode asp has no {said[0]} yet (docs/tensorflow.md); "
                                  "drop it or use the PyTorch runtime")
        missing = {"--accumulation-steps": self.accumulation_steps != 1, "--max-batch auto": self.max_batch == AUTO,
                   "--memory": self.memory is not None,
                   f"--emulator {self.emulator}": self.emulator not in ("delay", "none"),
                   "--loader-workers": self.loader_workers, "--device cuda": self.device == "cuda",
                   "--weight-decay with --optimizer sgd": self.weight_decay and self.optimizer == "sgd"}
        said = [flag for flag, asked in missing.items() if asked]
        if said:
            raise ConfigError(f"--framework tensorflow has no {said[0]} yet (BSP, delay emulation: "
                              "docs/tensorflow.md); drop it or use the PyTorch runtime")

    @property
    def milestone_epochs(self) -> tuple[int, ...]:
        if self.lr_schedule != "multistep":
            if self.milestones is not None:
                raise ConfigError("--milestones is only used with --lr-schedule multistep")
            return ()
        try:
            epochs = tuple(int(m) for m in (self.milestones or "").split(","))
        except ValueError:
            epochs = ()
        if not epochs or any(e < 1 for e in epochs) or list(epochs) != sorted(set(epochs)):
            raise ConfigError(f"--milestones {self.milestones!r} must be increasing epochs, e.g. 15,30,45")
        return epochs

    @property
    def sample_shape(self) -> tuple[int, ...] | None:
        if self.input_shape is None:
            return None
        try:
            shape = tuple(int(d) for d in self.input_shape.lower().replace(",", "x").split("x"))
        except ValueError:
            shape = ()
        if not shape or any(d < 1 for d in shape) or len(shape) > 3:
            raise ConfigError(f"--input-shape {self.input_shape!r} must be 1-3 positive sizes, e.g. 40 or 3x32x32")
        return shape


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


def workers_from_speeds(values: dict[str, Any], file_values: Mapping[str, Any]) -> None:
    """A comma list of n speeds means n workers unless ``--workers`` says otherwise; typed both, they must agree.

    ``values``: the flags as typed (``workers`` is set here when inferred); ``file_values``: a config file's,
    a preset's or a resumed run's. Speeds among the flags set the workers over a file's; a level (HL8)
    names no count (the default stays 4 workers). Not under torchrun, whose WORLD_SIZE decides.
    """
    typed = values.get("speeds")
    n = speed_count(typed if "speeds" in values else file_values.get("speeds"))
    if n is None:
        return
    given = values.get("workers")
    if given is None and ("speeds" in values or "workers" not in file_values):
        values["workers"] = n
    elif given is not None and speed_count(typed) not in (None, given):
        raise ConfigError(f"--speeds {typed} gives {n} workers but --workers is {given}; give one speed per worker, "
                          f"or drop --workers ({n} speeds start {n} workers)")

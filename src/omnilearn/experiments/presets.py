"""Paper workloads as TOML presets: ``omnilearn train --preset resnet18-food101 --data-dir DIR``.

Each file in ``presets/`` carries one workload's model, dataset and
hyper-parameters (learning rate, momentum, weight decay, milestones, global
batch, deadband, batch bounds). A preset is the lowest layer of settings:
``--config`` and flags override it, and the resolved config written to the
run directory records which preset it started from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omnilearn.experiments.config import ConfigError, load_toml

PRESET_DIR = Path(__file__).with_name("paper_presets")


def preset_names() -> tuple[str, ...]:
    return tuple(sorted(p.stem for p in PRESET_DIR.glob("*.toml")))


def load_preset(name: str) -> dict[str, Any]:
    """A preset's settings by name (or a path to a preset TOML file), with ``preset`` set to its name."""
    path = Path(name) if name.endswith(".toml") else PRESET_DIR / f"{name}.toml"
    if not path.is_file():
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(preset_names())} or give a .toml file")
    values = load_toml(str(path))
    values.pop("preset", None)
    builtin = path.parent.resolve() == PRESET_DIR.resolve()
    return {**values, "preset": path.stem if builtin else str(path.resolve())}  # config.toml can load it again

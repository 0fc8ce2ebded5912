"""Paper presets: every one loads, validates and names a real model and dataset; layering rules.

Run: ``python -m pytest -q tests/unit/test_presets.py``.
"""

from __future__ import annotations

import pytest

from omnilearn.experiments.args import config_from_args as _config
from omnilearn.experiments.cli import parser
from omnilearn.experiments.config import ConfigError, TrainConfig, dump_toml
from omnilearn.experiments.presets import PRESET_DIR, load_preset, preset_names

PAPER_WORKLOADS = {"resnet18-food101", "resnet50-caltech256", "vgg11-places365", "alexnet-cifar100",
                   "gpt2-shakespeare"}


def test_every_paper_workload_has_a_preset():
    assert set(preset_names()) == PAPER_WORKLOADS


@pytest.mark.parametrize("name", sorted(PAPER_WORKLOADS))
def test_preset_loads_and_validates(name):
    values = load_preset(name)
    cfg = TrainConfig(**values)
    assert cfg.preset == name
    assert cfg.model == name.split("-")[0]
    assert cfg.global_batch == 128 and cfg.workers == 4
    assert cfg.min_batch * cfg.workers <= cfg.global_batch <= cfg.upper_batch * cfg.workers
    if cfg.lr_schedule == "multistep":
        assert cfg.milestone_epochs[-1] <= cfg.epochs
    # The resolved config round-trips through TOML.
    assert "preset = " in dump_toml(cfg)


def _cfg(*argv: str) -> TrainConfig:
    return _config(parser().parse_args(["train", *argv]))


def test_flags_override_a_preset_and_a_preset_overrides_defaults():
    cfg = _cfg("--preset", "alexnet-cifar100", "--lr", "0.2", "--dataset", "synthetic", "--model", "alexnet",
               "--input-shape", "3x8x8")
    assert cfg.lr == 0.2 and cfg.momentum == 0.9 and cfg.milestones == "80,120,160" and cfg.dataset == "synthetic"


def test_a_config_file_sits_between_preset_and_flags(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[train]\npreset = "vgg11-places365"\nlr = 0.5\nmomentum = 0.5\n')
    cfg = _cfg("--config", str(path), "--momentum", "0.6")
    assert cfg.preset == "vgg11-places365" and cfg.lr == 0.5 and cfg.momentum == 0.6 and cfg.model == "vgg11"


def test_unknown_preset_names_the_choices(tmp_path):
    with pytest.raises(ConfigError, match="unknown preset 'resnet9'.*resnet18-food101"):
        _cfg("--preset", "resnet9")
    bad = tmp_path / "mine.toml"
    bad.write_text("[train]\nmodel = 'resnet18'\nlr = -1\n")
    with pytest.raises(ConfigError, match="--lr -1"):
        TrainConfig(**load_preset(str(bad)))


def test_presets_ship_with_the_package():
    assert PRESET_DIR.name == "paper_presets" and len(list(PRESET_DIR.glob("*.toml"))) == len(PAPER_WORKLOADS)


def test_under_torchrun_the_world_size_beats_the_presets_worker_count(monkeypatch):
    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(key, value)
    assert _cfg("--preset", "resnet18-food101").workers == 2
    with pytest.raises(ConfigError, match="--workers 3 does not match"):
        _cfg("--preset", "resnet18-food101", "--workers", "3")


def test_a_preset_file_is_recorded_so_config_toml_can_load_it_again(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text("[train]\nlr = 0.3\n")
    cfg = _cfg("--preset", str(path))
    assert cfg.preset == str(path.resolve()) and load_preset(cfg.preset)["lr"] == 0.3


def test_overriding_a_presets_schedule_drops_its_milestones():
    cfg = _cfg("--preset", "alexnet-cifar100", "--lr-schedule", "cosine")
    assert cfg.lr_schedule == "cosine" and cfg.milestones is None

"""Helpers for the multi-process tests: run ``omnilearn train`` in-process and read its run directory."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from omnilearn.experiments.cli import main


def train(out: Path, *flags: str) -> dict:
    code = main(["train", "--out", str(out), *flags])
    assert code == 0
    return json.loads((out / "summary.json").read_text())


def load_weights(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "model.pt", weights_only=True)

"""Zoo models, datasets and presets through ``omnilearn train`` on 2 real gloo workers.

BatchNorm vision models on synthetic image-shaped data (statistics averaged
across workers; every zoo model's few-step training is in tests/unit/test_models.py), ``gpt2-tiny`` on the default byte-level corpus (the loss
must fall), a paper preset with a synthetic stand-in for its data, and a
CIFAR-format directory on disk.
Run: ``python -m pytest -q tests/dist/test_zoo.py`` (about a minute on 2 cores).
"""

from __future__ import annotations

import pickle
from statistics import fmean

import numpy as np
import pytest

from omnilearn.decisions import SCRIPTED_ENV
from omnilearn.observe.metrics import read_metrics

from cli_run import load_weights, train

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("model", ["resnet18", "vgg11"])  # all four: tests/unit/test_models.py
def test_vision_model_trains_on_synthetic_images(tmp_path, model):
    out = tmp_path / model
    summary = train(out, "--model", model, "--dataset", "synthetic", "--input-shape", "3x8x8", "--num-classes", "5",
                    "--workers", "2", "--speeds", "2,1", "--global-batch", "32", "--max-steps", "4",
                    "--control-interval", "4", "--epochs", "1", "--no-plots")
    assert summary["steps"] == 4 and 0 <= summary["test_accuracy"] <= 1
    losses = [r["loss"] for r in read_metrics(out, "step")]
    assert all(np.isfinite(losses))
    assert load_weights(out)  # saved after the buffers were averaged


def test_gpt2_tiny_on_text_loss_falls(tmp_path, monkeypatch):
    monkeypatch.setenv(SCRIPTED_ENV, "0.001,0.002")  # the controller sees rank 1 twice as slow, however busy the host
    out = tmp_path / "gpt"
    summary = train(out, "--model", "gpt2-tiny", "--workers", "2", "--speeds", "2,1", "--global-batch", "32",
                    "--seq-len", "32", "--max-steps", "60", "--control-interval", "10", "--no-plots")
    loss = {}
    for r in read_metrics(out, "step"):
        loss[r["step"]] = loss.get(r["step"], 0.0) + r["loss"] * r["batch"] / 32
    first, last = fmean(loss[s] for s in range(10)), fmean(loss[s] for s in range(50, 60))
    assert last < first - 1.0, (first, last)  # bytes: ln(256) = 5.5 at the start
    assert summary["test_loss"] < first
    assert summary["rebalances"] >= 1


def test_paper_preset_runs_on_a_synthetic_stand_in(tmp_path):
    out = tmp_path / "preset"
    summary = train(out, "--preset", "resnet18-food101", "--dataset", "synthetic", "--input-shape", "3x8x8",
                    "--num-classes", "4", "--workers", "2", "--max-steps", "3", "--control-interval", "3",
                    "--no-plots")
    cfg = (out / "config.toml").read_text()
    assert 'preset = "resnet18-food101"' in cfg and "lr = 0.15" in cfg and 'milestones = "15,30,45"' in cfg
    assert summary["steps"] == 3
    assert {r["lr"] for r in read_metrics(out, "step")} == {0.15}  # milestones are epochs away


def test_cifar10_directory_on_disk(tmp_path):
    root = tmp_path / "cifar-10-batches-py"
    root.mkdir()
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {b"data": rng.integers(0, 256, (40, 3072), dtype=np.uint8), b"labels": list(rng.integers(0, 10, 40))}
        (root / name).write_bytes(pickle.dumps(batch))
    summary = train(tmp_path / "run", "--model", "resnet18", "--dataset", "cifar10", "--data-dir", str(tmp_path),
                    "--workers", "2", "--global-batch", "32", "--max-steps", "2", "--control-interval", "3",
                    "--no-plots")
    assert summary["steps"] == 2

"""MNIST-1D as numpy arrays: generated once by the ``mnist1d`` package on this machine, cached, normalised. No torch.

``mnist1d_arrays()`` gives ``x``/``x_test`` (float32, standardised by the
training set's mean and spread) and ``y``/``y_test`` (int64): the arrays
the PyTorch datasets (:mod:`omnilearn.experiments.datasets.core`) wrap and
the TensorFlow job (:mod:`omnilearn.experiments.train.tfjob`) feeds to Keras. The
raw arrays are cached as ``.npz`` under ``$OMNILEARN_CACHE`` (default
``~/.cache/omnilearn``); nothing is downloaded.

Run its tests:  python -m pytest -q tests/unit/test_data.py
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np

MNIST1D_SAMPLES = 12_500  # 10,000 train + 2,500 test
MNIST1D_DATA_SEED = 42  # the package's default generator seed


def cache_dir() -> Path:
    return Path(os.environ.get("OMNILEARN_CACHE", Path.home() / ".cache" / "omnilearn"))


def mnist1d_cache() -> Path:
    """Where mnist1d is cached once generated (the preflight checks its folder is writable until then)."""
    return cache_dir() / f"mnist1d-{MNIST1D_SAMPLES}-seed{MNIST1D_DATA_SEED}.npz"


def _mnist1d_arrays() -> tuple[dict[str, np.ndarray], bool]:
    """The arrays, and whether they came from the cache (else generated now, a few seconds, and cached)."""
    path = mnist1d_cache()
    if path.exists():
        with np.load(path) as f:
            return {k: f[k] for k in f.files}, True
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.num_samples, args.seed = MNIST1D_SAMPLES, MNIST1D_DATA_SEED
    d = make_dataset(args)
    arrays = {k: np.asarray(d[k]) for k in ("x", "y", "x_test", "y_test")}
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".npz", delete=False) as tmp:
        np.savez(tmp, **arrays)
    os.replace(tmp.name, path)  # atomic: concurrent first runs never see half a file
    return arrays, False


def mnist1d_arrays() -> tuple[dict[str, np.ndarray], str]:
    """The normalised arrays, and how they were had (read from the cache, or generated now)."""
    a, cached = _mnist1d_arrays()
    mean, std = a["x"].mean(), a["x"].std()
    out = {k: ((a[k] - mean) / std).astype(np.float32) for k in ("x", "x_test")}
    out.update({k: a[k].astype(np.int64) for k in ("y", "y_test")})
    how = "read from the cache" if cached else f"generated now by the mnist1d package, cached in {mnist1d_cache()}"
    return out, how

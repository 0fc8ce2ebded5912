"""The datasets' shared types: the error, the in-memory dataset and the train/test pair.

Every dataset module (:mod:`.core` for the generated ones, :mod:`.images`,
:mod:`.text`) builds its :class:`Splits` from these; :func:`.core.load`
dispatches to them, so this base module imports none of them (no cycle).

Run its tests:  python -m pytest -q tests/unit/test_data.py
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.data import Dataset


class DataError(ValueError):
    """A missing or malformed dataset; one line naming what was expected and the fix."""


class TensorData(Dataset):
    """Map-style dataset over in-memory tensors that fetches batches vectorised."""

    returns_batches = True  # __getitems__ returns a collated (x, y): use data.keep_batch as collate_fn

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if len(x) != len(y):
            raise ValueError(f"{len(x)} inputs but {len(y)} labels")
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.as_tensor(indices, dtype=torch.long)
        return self.x[idx], self.y[idx]


@dataclass(frozen=True)
class Splits:
    """Train and test datasets plus what a model needs to know; ``source`` says where the data came from."""

    train: Dataset
    test: Dataset
    num_classes: int
    input_shape: tuple[int, ...]
    source: str = ""

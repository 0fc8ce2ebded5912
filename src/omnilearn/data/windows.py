"""Random-window sampling for token streams: no dataset, no permutation, one seeded draw of ``B`` per step.

A nanoGPT-style trainer samples windows from one long token array
(``ix = torch.randint(len(data) - block, (batch,))``). With OmniLearn the
loop asks the session instead: ``ix = ol.random_indices(len(data) - block)``.
Global step ``s`` draws its ``B`` starts uniformly from ``[0, high)`` with a
generator seeded by ``(seed, s)`` (O(B) per step, never O(high)); worker
``i`` takes the contiguous slice ``[sum(b[:i]), sum(b[:i+1]))`` of them, cut
into micro-batches as the map-style path does. So the global batch is one
well-defined sample of ``B`` that does not depend on the number of workers or
the split, and a resumed run draws what an unstopped one does.

:class:`WindowPlan` is a :class:`~omnilearn.data.plan.GlobalPlan` whose
permutation is skipped; the sampler, loader, step clocks and checkpoints of
the map-style path are reused unchanged. An "epoch" is a nominal
``high // B`` steps (what the progress line and ``epoch`` count).

Run: ``python -m pytest -q tests/unit/test_windows.py``
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

from omnilearn.data.plan import GlobalPlan


@dataclass(frozen=True)
class WindowPlan(GlobalPlan):
    """Step ``s`` reads ``B`` uniform draws from ``[0, high)`` seeded by ``(seed, s)``; ``dataset_len`` is ``high``."""

    KIND = "random_indices"
    RESUME_FIELDS = ("global_batch", "dataset_len", "seed", "steps_per_epoch")  # nothing is dropped: no partial batch

    def __post_init__(self) -> None:
        if self.global_batch < 1 or self.dataset_len < 1:
            raise ValueError(f"random_indices({self.dataset_len}) needs a positive range to draw from")

    @property
    def steps_per_epoch(self) -> int:
        return max(1, self.dataset_len // self.global_batch)

    def permutation(self, epoch: int) -> None:  # type: ignore[override]
        return None  # nothing to shuffle: each step draws its own

    def step_indices(self, step: int, perm: np.ndarray | None = None) -> np.ndarray:
        return np.random.default_rng([self.seed, 1, step]).integers(0, self.dataset_len, self.global_batch)


class IndexStream:
    """Hands out this rank's index tensors one micro-batch at a time from a loader over a :class:`WindowPlan`."""

    def __init__(self, loader, high: int) -> None:
        self.loader, self.high = loader, high
        self._it: Iterator | None = None
        self._pending: list = []

    def next(self) -> torch.Tensor:
        while not self._pending:
            if self._it is None:
                self._it = iter(self.loader)
            try:
                item = next(self._it)
            except StopIteration:
                self._it = None  # the nominal epoch ended: the next one starts
                if not len(self.loader):
                    raise RuntimeError("random_indices(): the run's total_steps are done") from None
                continue
            self._pending = list(item) if self.loader.micro_steps > 1 else [item]
        return torch.as_tensor(self._pending.pop(0), dtype=torch.int64)

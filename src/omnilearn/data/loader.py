"""The training loader of a session: this rank's slice of every global batch, one epoch per ``iter()``.

:class:`BalancedLoader` wraps a ``DataLoader`` whose ``batch_sampler`` is a
:class:`~omnilearn.data.plan.VariableBatchSampler`; it tells the session
when each step's batch is handed out (the start of the step's clock).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from torch.utils.data import DataLoader

from omnilearn.data.plan import VariableBatchSampler


def keep_batch(batch):
    """``collate_fn`` for datasets whose ``__getitems__`` returns an already collated batch."""
    return batch


class BalancedLoader:
    """Iterates this rank's batches of one epoch; each ``iter()`` moves to the next epoch."""

    def __init__(self, loader: DataLoader, sampler: VariableBatchSampler, begin: Callable[[int], None]) -> None:
        self.loader, self.sampler, self._begin = loader, sampler, begin
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        self.sampler.set_epoch(self.epoch)
        return len(self.sampler)

    def __iter__(self) -> Iterator[Any]:
        self.sampler.set_epoch(self.epoch)
        self.epoch += 1  # also when the loop breaks early
        steps = self.sampler.steps()
        batches = iter(self.loader)
        for step in steps:
            self._begin(step)  # the session starts the step's clock
            yield next(batches)

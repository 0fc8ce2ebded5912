"""The training loader of a session: this rank's slice of every global batch.

:class:`BalancedLoader` wraps a ``DataLoader`` whose ``batch_sampler`` is a
:class:`~omnilearn.data.plan.VariableBatchSampler`, and tells its owner (a
callback, ``on_batch(step, restart)``) each time it hands out a step. With
``accumulation_steps = k > 1`` one item is a list of the step's ``k``
micro-batches, else the batch itself.

Where an iteration starts (the habits of ``DataLoader`` users, kept):

- ``for batch in loader`` run to the end moves to the next epoch;
- a loop that stops early (``break``), or a peek (``next(iter(loader))``),
  leaves the epoch where the last *reported* step ended: the next
  ``iter()`` hands out the first step not yet reported by ``ol.step()``
  again (``restart=True`` tells the owner to forget the steps handed out and
  not reported). ``loader.set_epoch(e)`` / ``loader.sampler.set_epoch(e)``
  moves on to epoch ``e`` instead (never back: that is an error);
- one iterator at a time: advancing an iterator that a newer ``iter()``
  replaced is an error.

Run: ``python -m pytest -q tests/unit/test_sampler.py tests/dist/test_api.py``
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from torch.utils.data import DataLoader

from omnilearn.data.plan import VariableBatchSampler


def keep_batch(batch):
    """``collate_fn`` for datasets whose ``__getitems__`` returns an already collated batch."""
    return batch


class BalancedLoader:
    """Iterates this rank's steps from the sampler's place; see the module docstring."""

    def __init__(self, loader: DataLoader, sampler: VariableBatchSampler, on_batch: Callable[[int, bool], None],
                 micro_steps: int = 1) -> None:
        self.loader, self.on_batch, self.micro_steps = loader, on_batch, micro_steps
        self._sampler = sampler
        self._generation = 0
        self._clean = True  # the last iteration ran to its end (or there was none)

    @property
    def dataset(self):
        return self.loader.dataset

    @property
    def sampler(self) -> VariableBatchSampler:
        """The batch sampler: ``set_epoch``, ``state_dict`` and the data order live here."""
        return self._sampler

    batch_sampler = sampler

    @property
    def num_workers(self) -> int:
        return self.loader.num_workers

    @property
    def epoch(self) -> int:
        """The epoch the next iteration serves."""
        return self._sampler.epoch

    def set_epoch(self, epoch: int) -> None:
        self._sampler.set_epoch(epoch)

    def __len__(self) -> int:
        """Steps (optimizer steps) the next iteration hands out."""
        return len(self._sampler.steps())

    def __iter__(self) -> Iterator[Any]:
        self._generation += 1
        restart, self._clean = not self._clean, False
        steps, epoch = self._sampler.steps(), self._sampler.epoch
        batches = iter(self.loader)  # the sampler's place is read here, with ``steps``
        return self._iterate(self._generation, batches, steps, epoch, restart)

    def _iterate(self, generation: int, batches: Iterator[Any], steps: range, epoch: int,
                 restart: bool) -> Iterator[Any]:
        for step in steps:
            if generation != self._generation:
                raise RuntimeError("this loader iterator was replaced by a newer iter(loader), which hands out the "
                                   "steps from the first one not reported by ol.step(); use one iterator at a time")
            self.on_batch(step, restart)  # the owner starts the step's clock (or queues it)
            restart = False
            if self.micro_steps == 1:
                yield next(batches)
            else:
                yield [next(batches) for _ in range(self.micro_steps)]
        if generation == self._generation:
            self._clean = True
            if steps:
                self._sampler.end_epoch(epoch)

    def shutdown(self) -> None:
        """End the DataLoader's persistent worker processes now (idempotent; a later ``iter`` starts new ones).

        Left to the garbage collector, a session's loader sits in a reference cycle with it, and the collector
        closes the workers' queues before the iterator asks them to stop: each worker then took its full 5 s
        timeout to be joined (a notebook re-running a cell, a test suite)."""
        iterator = getattr(self.loader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
            self.loader._iterator = None

    def state_dict(self) -> dict:
        return self._sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._sampler.load_state_dict(state)

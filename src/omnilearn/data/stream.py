"""``IterableDataset`` streams: each worker takes its ``b_i`` items per step from its own stream.

A stream has no length and no index, so there is nothing to permute: each
rank iterates its own stream (shard it by rank as with any torch stream,
e.g. ``split_dataset_by_node`` or ``get_worker_info`` plus the rank), and
step ``s`` takes the next ``b_i`` items (``accumulation_steps`` micro-batches
cut as the map-style path cuts them) and collates them. Per step that costs
``b_i`` items, nothing per epoch. The run's length comes from
``omnilearn.setup(total_steps=N)`` (one nominal "epoch" of ``N`` steps); a
stream that runs dry is reopened (``set_epoch(k)`` first when the dataset has
it), so every rank keeps stepping together.

Resume: the items of the steps already trained are recomputed from the
batch schedule (``sum(b_rank(s) for s < step)``) and skipped when the stream
is opened: O(items consumed) once, exact for a stream that replays the same
items. A resume at another worker count starts each rank's stream afresh.
An iteration abandoned mid-epoch (``break``) leaves the stream where it was:
items handed out for steps never reported are not handed out again.

Run: ``python -m pytest -q tests/unit/test_streams.py``
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

from torch.utils.data import DataLoader, IterableDataset, default_collate

from omnilearn.data.plan import GlobalPlan, VariableBatchSampler, micro_sizes


@dataclass(frozen=True)
class StreamPlan(GlobalPlan):
    """A stream's plan: ``dataset_len`` is ``total_steps x B`` (one epoch is the run); no indices are made.

    A resume may lengthen the run: its items are skipped by count, so only the batch must match."""

    KIND = "stream"
    RESUME_FIELDS = ("global_batch",)

    def permutation(self, epoch: int) -> None:  # type: ignore[override]
        return None

    def worker_indices(self, step, batches, rank, perm=None) -> list[int]:  # pragma: no cover - never asked
        raise RuntimeError("a stream has no indices")


class StreamBatches:
    """Iterates this rank's micro-batches of a stream, step by step, from the sampler's place."""

    def __init__(self, dataset: IterableDataset, sampler: VariableBatchSampler, collate_fn: Callable | None = None,
                 num_workers: int = 0) -> None:
        self.dataset, self.sampler = dataset, sampler
        self.collate = collate_fn or default_collate
        self.num_workers = num_workers
        self.source = DataLoader(dataset, batch_size=None, num_workers=num_workers) if num_workers else dataset
        self.items: Iterator | None = None
        self.pulled = 0  # items taken from this rank's stream so far (over reopenings)
        self.reopened = 0

    def consumed_before(self, step: int) -> int:
        """Items this rank trained on in steps ``[0, step)``, by the batch schedule."""
        schedule, rank = self.sampler.schedule, self.sampler.rank
        return sum(schedule.peek(s)[rank] for s in range(step))

    def _next_item(self) -> Any:
        for _ in range(2):
            if self.items is None:
                self.items = iter(self.source)
            try:
                item = next(self.items)
                self.pulled += 1
                return item
            except StopIteration:
                self.items = None
                self.reopened += 1
                if hasattr(self.dataset, "set_epoch"):
                    self.dataset.set_epoch(self.reopened)
        raise RuntimeError(f"the stream {type(self.dataset).__name__} yields no items, even after reopening it")

    def __iter__(self) -> Iterator[Any]:
        steps = self.sampler.steps()
        if steps and self.items is None and self.pulled == 0:
            for _ in range(self.consumed_before(steps[0])):  # a resumed run: skip what was trained on
                self._next_item()
        return self._batches(steps)

    def _batches(self, steps: range) -> Iterator[Any]:
        for step in steps:
            batch = self.sampler.schedule.at(step)[self.sampler.rank]
            for size in micro_sizes(batch, self.sampler.micro_steps):
                yield self.collate([self._next_item() for _ in range(size)])

"""The session's training data: ``ol.data_loader`` (a dataset or a stream) and ``ol.random_indices``.

A mixin of :class:`~omnilearn.bsp.session.Session` (it uses the session's
``cfg``, ``ctx``, ``sampler``, ``schedule``, ``ledger``...). One training data
source per session: the first one plans the run over its size
(:func:`~omnilearn.runplan.plan_run`, every rank agreeing on the size and the
deepest prefetch, :func:`~omnilearn.bsp.interval.agree_on_data`) and starts
rank 0's record. Each step the loader hands out this rank's slice of the
global batch (:class:`~omnilearn.data.loader.BalancedLoader`) and the ledger
starts the step's clock.

Run: ``python -m pytest -q tests/dist/test_api.py tests/unit/test_sampler.py``
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, IterableDataset

from omnilearn.bsp.interval import agree_on_data
from omnilearn.bsp.rng import rank_seed
from omnilearn.config import ConfigError, api_wording
from omnilearn.data.loader import BalancedLoader, keep_batch
from omnilearn.data.plan import GlobalPlan
from omnilearn.data.stream import StreamBatches, StreamPlan
from omnilearn.data.windows import IndexStream, WindowPlan
from omnilearn.distributed.collect import share_path
from omnilearn.observe.rankrows import RankRows
from omnilearn.observe.recorder import Telemetry
from omnilearn.runplan import plan_run


class DataSources:
    """``data_loader``, ``random_indices`` and ``local_batch`` (see the module docstring)."""

    def data_loader(self, dataset, *, num_workers: int = 0, collate_fn=None, pin_memory: bool | None = None,
                    prefetch_factor: int | None = None) -> BalancedLoader:
        """A loader over a map-style ``dataset`` or an ``IterableDataset``: each step, this rank's share.

        A stream (:mod:`omnilearn.data.stream`) gives each step its next ``b_i`` items; it needs ``total_steps``.
        """
        if isinstance(dataset, IterableDataset):
            return self._stream_loader(dataset, collate_fn, num_workers)
        prefetch = (prefetch_factor or 2) if num_workers > 0 else 0
        self._start_data(GlobalPlan, len(dataset), num_workers * prefetch)
        if collate_fn is None and getattr(dataset, "returns_batches", False):
            collate_fn = keep_batch
        # Its own generator: making an iterator (each epoch, and after a resume mid-epoch) then draws no number
        # from the global stream that dropout and augmentation use, so a resumed run draws what an unstopped one does.
        generator = torch.Generator().manual_seed(rank_seed(self.cfg.seed, self.rank))
        loader = DataLoader(
            dataset, batch_sampler=self.sampler, collate_fn=collate_fn, num_workers=num_workers, generator=generator,
            persistent_workers=num_workers > 0, prefetch_factor=prefetch_factor if num_workers > 0 else None,
            pin_memory=self.device.type == "cuda" if pin_memory is None else pin_memory,
        )
        self.loader = BalancedLoader(loader, self.sampler, self.ledger.handed_out, self.cfg.accumulation_steps)
        return self.loader

    def _stream_loader(self, dataset: IterableDataset, collate_fn, num_workers: int) -> BalancedLoader:
        if self.total_steps is None:
            raise ConfigError(f"data_loader({type(dataset).__name__}): a stream has no length; pass total_steps=N "
                              "to omnilearn.setup()")
        self._start_data(StreamPlan, self.total_steps * self.cfg.global_batch, 0, "stream")
        items = StreamBatches(dataset, self.sampler, collate_fn, num_workers)
        self.loader = BalancedLoader(items, self.sampler, self.ledger.handed_out, self.cfg.accumulation_steps)
        return self.loader

    def random_indices(self, high: int) -> torch.Tensor:
        """This rank's next micro-batch of random window starts in ``[0, high)`` (int64): nanoGPT's ``torch.randint``.

        Step ``s`` draws ``B`` starts seeded by ``(seed, s)``; this rank takes its slice
        (:mod:`omnilearn.data.windows`). Call it once per micro-batch (``accumulation_steps`` per step);
        the first call of a step starts its clock; fetching the next batch ahead is fine.
        """
        if self.windows is None:
            if type(high) is not int or high < 1:
                raise ConfigError(f"random_indices({high!r}): high must be a positive int (e.g. len(data) - block)")
            self._start_data(WindowPlan, high, 0, "random_indices() range")
            self.loader = BalancedLoader(self.sampler, self.sampler, self.ledger.handed_out,
                                         self.cfg.accumulation_steps)
            self.windows = IndexStream(self.loader, high)
        elif high != self.windows.high:
            raise ConfigError(f"random_indices({high}) after random_indices({self.windows.high}): the range is fixed "
                              "for a run; draw from one array")
        return self.windows.next()

    @property
    def local_batch(self) -> int:
        """This rank's batch in the next step handed out (what a loop that draws its own samples takes)."""
        return self.batches[self.rank]

    def _start_data(self, plan_type: type[GlobalPlan], size: int, prefetch_batches: int, what: str = "dataset") -> None:
        """Plan the run over ``size`` samples (one training data source per session); rank 0 starts the record.

        Every rank must read a source of the same size, and plans with the deepest prefetch of any rank (the
        same lag everywhere, so the same decisions): :func:`~omnilearn.bsp.interval.agree_on_data`.
        """
        if self.loader is not None:
            raise RuntimeError("data_loader() or random_indices() was already used: one training data source "
                               "per session")
        prefetch_batches = agree_on_data(self.ctx, size, prefetch_batches, what)
        try:
            self.run = plan_run(self.cfg, size if plan_type is GlobalPlan else max(size, self.cfg.global_batch),
                                self.total_steps, prefetch_batches, what, warn=self.is_main)
        except ConfigError as e:  # the API's user typed keywords, not flags
            raise ConfigError(api_wording(str(e))) from None
        self.loop.lag = self.run.lag
        self.sampler.use_plan(plan_type(size, self.cfg.global_batch, self.cfg.seed))
        self.rank_rows = RankRows(self.rank, self.run.steps_per_epoch, share_path(self.ctx, self.run_dir))
        if self.is_main:
            self.telemetry = Telemetry(self.cfg, self.run, self.run_dir, own_rows=True)
        self.restore_telemetry()

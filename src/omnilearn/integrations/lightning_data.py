"""The data side of :class:`~omnilearn.integrations.lightning.OmniLearnStrategy`: training and evaluation loaders.

Training (:func:`training_loader`): the user's ``DataLoader`` is rebuilt by
``Session.data_loader`` over the same dataset with its ``collate_fn``,
``num_workers``, ``pin_memory``, ``prefetch_factor``, ``worker_init_fn``,
``timeout`` and ``multiprocessing_context`` (a stream, an ``IterableDataset``,
needs the run's length: ``max_steps``); its ``batch_size`` is
OmniLearn's to set (``b_i`` per step). A custom ``sampler`` or
``batch_sampler``, or ``shuffle=False``, is refused in one line: OmniLearn's
sampler orders the data (a seeded shuffle per epoch). Lightning iterates a
:class:`StepLoader`:

- with ``accumulate_grad_batches = K`` each optimizer step's ``K``
  micro-batches come one by one (Lightning calls ``training_step`` on each);
- ``len()`` is a whole epoch's items (steps x ``K``) even when the session
  resumes mid-epoch: Lightning's restored batch count plus the items left
  then make the epoch, so Lightning's epochs and the session's stay one;
- it has no ``sampler`` (Lightning's ``set_epoch`` would move the session's
  epoch); the epoch moves when an iteration runs to its end;
- ``state_dict()`` is the session's data position; ``load_state_dict()``
  checks that the resumed session stands there (the session's state itself
  rides in the checkpoint under ``"omnilearn"``).

Evaluation (:func:`evaluation_loader`): in a group of ``W`` ranks each rank
evaluates a disjoint part of the validation/test set (Lightning's
``UnrepeatedDistributedSampler``: no sample padded in twice; predict loaders
are sharded by Lightning itself, as under ``DDPStrategy``); metrics logged
with ``self.log(..., sync_dist=True)`` are averaged over every sample
(Lightning sums the per-rank sums and the per-rank sample counts).

Run: ``python -m pytest -q tests/dist/test_lightning_strategy.py tests/dist/test_lightning_exact.py``
"""

from __future__ import annotations

from typing import Any, Iterator

from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler

from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from lightning.pytorch.utilities.data import _update_dataloader
from torch.utils.data.distributed import DistributedSampler

from omnilearn.config import ConfigError

AFTER_BUILD = ("worker_init_fn", "timeout", "multiprocessing_context")  # set on the session's DataLoader


class StepLoader:
    """What Lightning iterates for training: the session's steps, ``K`` micro-batches each (module docstring)."""

    def __init__(self, session: Any, dataset: Any) -> None:
        self.session, self.dataset = session, dataset
        self.micro_steps = session.cfg.accumulation_steps

    def __len__(self) -> int:
        return self.session.run.steps_per_epoch * self.micro_steps

    def __iter__(self) -> Iterator[Any]:
        steps = iter(self.session.loader)  # the session's place is read now
        return steps if self.micro_steps == 1 else (batch for micro in steps for batch in micro)

    def state_dict(self) -> dict:
        return {"omnilearn_position": self.session.sampler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        saved, now = state.get("omnilearn_position"), self.session.sampler.state_dict()
        if saved is not None and saved != now:
            raise RuntimeError(f"the checkpoint's loader stood at {saved} but the resumed OmniLearn session stands at "
                               f"{now}: the checkpoint's 'omnilearn' state does not match its loops")


def training_loader(session: Any, loader: Any) -> StepLoader:
    """``Session.data_loader`` over ``loader``'s dataset with its settings; what Lightning iterates (docstring)."""
    if session.loader is not None:
        if getattr(loader, "dataset", None) is not session.loader.dataset:
            raise ConfigError("the training DataLoader changed during fit (reload_dataloaders_every_n_epochs?): "
                              "OmniLearn plans one training dataset per run; return the same dataset")
        return StepLoader(session, session.loader.dataset)
    if not isinstance(loader, DataLoader):
        raise ConfigError(f"the training data is a {type(loader).__name__}, not a torch DataLoader: OmniLearnStrategy "
                          "rebuilds the DataLoader to hand each worker its share; return a DataLoader")
    stream = isinstance(loader.dataset, IterableDataset)
    if stream and session.total_steps is None:
        raise ConfigError(f"the training data is a stream ({type(loader.dataset).__name__}, no length): give the run's "
                          "length, Trainer(max_steps=N) (Fabric: OmniLearnFabricStrategy(total_steps=N))")
    if not stream:
        _check_order(loader)
    options = {"num_workers": loader.num_workers, "collate_fn": loader.collate_fn}
    if not stream:
        options.update(pin_memory=loader.pin_memory, prefetch_factor=loader.prefetch_factor)
    session.data_loader(loader.dataset, **options)
    _copy_after_build(loader, getattr(session.loader, "loader", None))
    return StepLoader(session, loader.dataset)


def _check_order(loader: DataLoader) -> None:
    if type(loader.batch_sampler) is not BatchSampler:
        raise ConfigError(f"DataLoader(batch_sampler={type(loader.batch_sampler).__name__}) for training: OmniLearn's "
                          "sampler hands each worker its share of every global batch; drop the batch_sampler")
    if type(loader.sampler) is not RandomSampler and not isinstance(loader.sampler, DistributedSampler):
        what = "shuffle=False" if type(loader.sampler).__name__ == "SequentialSampler" else \
            f"sampler={type(loader.sampler).__name__}"
        raise ConfigError(f"DataLoader({what}) for training: OmniLearn's sampler orders the data (a seeded shuffle "
                          "each epoch, omnilearn seed=); pass shuffle=True")


def _copy_after_build(source: DataLoader, built: DataLoader | None) -> None:
    """The settings ``Session.data_loader`` does not take, set on the ``DataLoader`` it built (before any iteration)."""
    for name in AFTER_BUILD:
        value = getattr(source, name)
        default = 0 if name == "timeout" else None
        if value is None or value == default:
            continue
        if built is None:
            raise ConfigError(f"DataLoader({name}={value!r}) cannot be honoured for a stream (IterableDataset) under "
                              "OmniLearnStrategy; drop it")
        setattr(built, name, value)


def evaluation_loader(loader: Any, rank: int, world_size: int, stage: Any) -> Any:
    """``loader`` over this rank's disjoint part of its dataset (module docstring); itself when nothing to shard."""
    if world_size < 2 or not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        return loader
    if isinstance(loader.sampler, DistributedSampler) or type(loader.batch_sampler) not in (BatchSampler, type(None)):
        return loader  # sharded by the user already
    sampler = UnrepeatedDistributedSampler(loader.dataset, num_replicas=world_size, rank=rank, shuffle=False)
    return _update_dataloader(loader, sampler, mode=stage)

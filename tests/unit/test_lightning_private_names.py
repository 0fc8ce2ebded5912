"""Lightning's private (and overridden) names the two Lightning doors rely on: each fails loudly when it changes.

``OmniLearnStrategy`` and ``OmniLearnFabricStrategy`` read or override names
Lightning does not promise to keep (``trainer._accelerator_connector``,
``fit_loop._data_source``, ``DDPStrategy._setup_model``, ``_ddp_kwargs``,
``_layer_sync``, Fabric's ``_BackwardSyncControl`` and
``_backward_sync_control``, ``lightning.pytorch.utilities.data._update_dataloader``;
the survivors' save: ``trainer._checkpoint_connector.dump_checkpoint``, the
``"loops"``/``"fit_loop"`` keys it writes, ``OnExceptionCheckpoint.ckpt_path``
and Fabric's ``_convert_stateful_objects_in_state``)
and override hooks whose parameters they name. Each has a check here: it
exists, takes the parameters the door passes or receives, and (for an
override) Lightning still calls it. A failure here means the installed
Lightning changed under the door: adapt the door, re-run its tests, and move
the tested range (``omnilearn.versions.TESTED["lightning"]``; tested on
lightning 2.6.6).

Run: ``python -m pytest -q tests/unit/test_lightning_private_names.py`` (skipped without lightning)
"""

from __future__ import annotations

import inspect

import pytest

pl = pytest.importorskip("lightning.pytorch")
from lightning.fabric import Fabric  # noqa: E402
from lightning.fabric.strategies import DDPStrategy as FabricDDP  # noqa: E402
from lightning.fabric.strategies.strategy import _BackwardSyncControl  # noqa: E402
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from lightning.pytorch.trainer.connectors import data_connector  # noqa: E402
from lightning.pytorch.utilities import data as pl_data  # noqa: E402


def parameters(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


@pytest.mark.parametrize("owner, name, expected", [
    # Lightning's DDPStrategy: OmniLearnStrategy overrides these (and calls super() with these parameters)
    (DDPStrategy, "_setup_model", ["self", "model"]),
    (DDPStrategy, "setup", ["self", "trainer"]),
    (DDPStrategy, "teardown", ["self"]),
    (DDPStrategy, "process_dataloader", ["self", "dataloader"]),
    (DDPStrategy, "backward", ["self", "closure_loss", "optimizer", "args", "kwargs"]),
    (DDPStrategy, "block_backward_sync", ["self"]),
    (DDPStrategy, "optimizer_step", ["self", "optimizer", "closure", "model", "kwargs"]),
    (DDPStrategy, "save_checkpoint", ["self", "checkpoint", "filepath", "storage_options"]),
    (DDPStrategy, "load_checkpoint", ["self", "checkpoint_path", "weights_only"]),
    (DDPStrategy, "on_train_batch_start", ["self", "batch", "batch_idx"]),
    (DDPStrategy, "barrier", ["self", "args", "kwargs"]),
    (DDPStrategy, "on_exception", ["self", "exception"]),
    # Fabric's DDPStrategy: OmniLearnFabricStrategy overrides these
    (FabricDDP, "setup_module", ["self", "module"]),
    (FabricDDP, "process_dataloader", ["self", "dataloader"]),
    (FabricDDP, "backward", ["self", "tensor", "module", "args", "kwargs"]),
    (FabricDDP, "optimizer_step", ["self", "optimizer", "kwargs"]),
    (FabricDDP, "save_checkpoint", ["self", "path", "state", "storage_options", "filter"]),
    (FabricDDP, "load_checkpoint", ["self", "path", "state", "strict", "weights_only"]),
    (_BackwardSyncControl, "no_backward_sync", ["self", "module", "enabled"]),
    # the Fabric door's survivors' save: the state's objects to state dicts, as fabric.save does (no collective)
    (FabricDDP, "_convert_stateful_objects_in_state", ["self", "state", "filter"]),
    # both strategies make the group themselves under torchrun, with the backend and timeout Lightning would use
    (DDPStrategy, "_get_process_group_backend", ["self"]),
    (FabricDDP, "_get_process_group_backend", ["self"]),
    (DDPStrategy, "setup_distributed", ["self"]),
    (FabricDDP, "setup_environment", ["self"]),
    # called by the doors
    (pl_data, "_update_dataloader", ["dataloader", "sampler", "mode"]),
    (data_connector._DataLoaderSource, "dataloader", ["self"]),
])
def test_overridden_or_called_names_keep_their_parameters(owner, name, expected):
    assert hasattr(owner, name), f"{owner.__name__}.{name} is gone: the Lightning door relies on it"
    assert parameters(getattr(owner, name)) == expected, f"{owner.__name__}.{name} changed its parameters"


def test_lightning_still_calls_the_overridden_private_hooks():
    assert "self._setup_model(" in inspect.getsource(DDPStrategy), "DDPStrategy no longer wraps through _setup_model"
    assert "._backward_sync_control" in inspect.getsource(Fabric.no_backward_sync), \
        "fabric.no_backward_sync no longer asks the strategy's _backward_sync_control"
    requires = inspect.getsource(data_connector._DataConnector._requires_distributed_sampler)
    assert "_accelerator_connector.use_distributed_sampler" in requires, \
        "Lightning no longer reads use_distributed_sampler where OmniLearnStrategy sets it"
    assert isinstance(FabricDDP.distributed_sampler_kwargs, property)


def test_trainer_private_attributes_the_strategy_reads_and_sets():
    from datetime import timedelta

    from omnilearn.integrations.lightning import OmniLearnStrategy

    trainer = pl.Trainer(strategy=OmniLearnStrategy(find_unused_parameters=True), accelerator="cpu", devices=1,
                         logger=False, sync_batchnorm=True, enable_progress_bar=False, enable_model_summary=False)
    assert isinstance(trainer._accelerator_connector.use_distributed_sampler, bool)
    assert isinstance(trainer.fit_loop._data_source, data_connector._DataLoaderSource)
    assert trainer.strategy._ddp_kwargs == {"find_unused_parameters": True}
    assert trainer.strategy._layer_sync is not None  # sync_batchnorm=True reaches the strategy there (refused at fit)
    assert isinstance(trainer.strategy._timeout, timedelta)  # the group's timeout the strategy makes it with


def test_fabric_strategy_private_attributes():
    from datetime import timedelta

    from omnilearn.integrations.lightning_fabric import OmniLearnFabricStrategy

    strategy = OmniLearnFabricStrategy(global_batch=8, bucket_cap_mb=2)
    assert isinstance(strategy._timeout, timedelta)  # the group's timeout, as Fabric would give it
    assert "_init_dist_connection" in inspect.getsource(FabricDDP._setup_distributed)  # skipped for a group made
    assert strategy._ddp_kwargs == {"bucket_cap_mb": 2}
    assert isinstance(strategy._backward_sync_control, _BackwardSyncControl)
    assert isinstance(FabricDDP()._backward_sync_control, _BackwardSyncControl)  # what the door replaces


def test_unrepeated_sampler_takes_the_evaluation_loaders_arguments():
    sampler = UnrepeatedDistributedSampler(list(range(5)), num_replicas=2, rank=1, shuffle=False)
    assert list(sampler) == [1, 3]


def test_the_survivors_save_reads_the_checkpoint_connector():
    """lightning_rescue: ``dump_checkpoint(weights_only=False)`` builds the checkpoint without collectives, with the
    fit loop's state under ``loops/fit_loop`` (replaced by the last step end's); ``fit(ckpt_path="last")`` reads
    ``OnExceptionCheckpoint.ckpt_path``; Lightning calls the strategy's ``on_exception``."""
    from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
    from lightning.pytorch.trainer import call
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    assert parameters(_CheckpointConnector.dump_checkpoint) == ["self", "weights_only"]
    source = inspect.getsource(_CheckpointConnector.dump_checkpoint)
    assert '"loops": self._get_loops_state_dict()' in source
    assert '"fit_loop": self.trainer.fit_loop.state_dict()' in inspect.getsource(_CheckpointConnector._get_loops_state_dict)
    assert "barrier" not in source and "broadcast" not in source and "reduce" not in source
    assert isinstance(OnExceptionCheckpoint.ckpt_path, property)
    assert (ModelCheckpoint.CHECKPOINT_NAME_LAST, ModelCheckpoint.FILE_EXTENSION) == ("last", ".ckpt")
    assert 'getattr(ft, "ckpt_path", None)' in inspect.getsource(_CheckpointConnector._parse_ckpt_path)
    assert "trainer.strategy.on_exception(exception)" in inspect.getsource(call._interrupt)
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    assert isinstance(trainer._checkpoint_connector, _CheckpointConnector)


def test_the_boundary_walks_the_loops_as_their_state_dict_does():
    """lightning_rescue.Boundary keeps the counters of the progress objects ``_Loop.state_dict`` reads (found the
    same way) and the epoch loop's ``_batches_that_stepped``, which it saves under ``state_dict``."""
    from lightning.pytorch.loops.loop import _Loop
    from lightning.pytorch.loops.progress import _BaseProgress
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    walk = inspect.getsource(_Loop.state_dict)
    assert "isinstance(v, _BaseProgress)" in walk and "isinstance(v, _Loop)" in walk and "self.__dict__" in walk
    assert "self._batches_that_stepped" in inspect.getsource(_TrainingEpochLoop.on_save_checkpoint)
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    assert isinstance(trainer.fit_loop.epoch_loop._batches_that_stepped, int)

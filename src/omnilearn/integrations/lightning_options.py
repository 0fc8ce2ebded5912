"""``OmniLearnStrategy(**options)``: which keyword goes where (Lightning, DDP, OmniLearn), and which is refused.

:func:`split_options` sorts the strategy's keywords into three groups:

- Lightning's ``DDPStrategy`` arguments (``accelerator``, ``cluster_environment``,
  ``checkpoint_io``, ``precision_plugin``, ``process_group_backend``, ``timeout``,
  ``start_method``, ``parallel_devices``);
- ``DistributedDataParallel`` arguments (``find_unused_parameters``,
  ``static_graph``, ``gradient_as_bucket_view``, ``bucket_cap_mb``...): they
  reach ``Session.wrap_model(model, **ddp_kwargs)``;
- :func:`omnilearn.setup` keywords (``global_batch``, ``speeds``, ``out``...).

:func:`refuse_trainer_flags` refuses, at fit, the Trainer flags OmniLearn
cannot honour: a ``GradScaler`` precision (``16-mixed``),
``sync_batchnorm=True``, and ``limit_train_batches`` / ``fast_dev_run`` /
``overfit_batches`` (they cut the epochs OmniLearn plans; ``max_steps``
shortens a run).

Refused by name, each in one line with the supported route: a DDP comm hook
or model averaging (OmniLearn weights and times DDP's own C++ reduction, which
a hook would replace), DDP's ``mixed_precision`` (its own comm hook) and ``delay_all_reduce_named_params`` /
``param_to_hook_all_reduce`` (an unweighted all-reduce outside the hook), buffer
broadcasting (OmniLearn averages buffers by batch share), ``total_steps``
(the Trainer's ``max_steps``), ``accumulation_steps`` (the Trainer's
``accumulate_grad_batches``), ``device`` (the Trainer's ``accelerator`` and
``devices``), and any keyword none of the three takes. Fabric's strategy
(:mod:`omnilearn.integrations.lightning_fabric`) has no Trainer: it takes
``total_steps`` and ``accumulation_steps`` as ``omnilearn.setup()`` keywords
and Fabric's ``precision`` in place of ``precision_plugin``.

Run: ``python -m pytest -q tests/dist/test_lightning_strategy.py``
"""

from __future__ import annotations

import inspect
from typing import Any

from torch.nn.parallel import DistributedDataParallel

from omnilearn.config import ConfigError
from omnilearn.keywords import KEYWORDS

LIGHTNING_ARGS = frozenset({"accelerator", "parallel_devices", "cluster_environment", "checkpoint_io",
                            "precision_plugin", "process_group_backend", "timeout", "start_method"})
DDP_ARGS = frozenset(inspect.signature(DistributedDataParallel).parameters) - {
    "module", "device_ids", "output_device", "process_group", "device_mesh"}
BUFFER_BROADCAST = ("broadcast_buffers", "forward_sync_buffers")  # the flag's name changed in torch 2.13

REFUSED = {
    "ddp_comm_hook": "OmniLearn weights each worker by b_i/B and times DDP's own C++ reduction, which a comm hook would replace",
    "ddp_comm_state": "OmniLearn weights each worker by b_i/B and times DDP's own C++ reduction, which a comm hook would replace",
    "ddp_comm_wrapper": "OmniLearn weights each worker by b_i/B and times DDP's own C++ reduction, which a comm hook would replace",
    "model_averaging_period": "post-local SGD averages models unweighted; OmniLearn's steps are synchronous",
    "mixed_precision": "DDP's mixed_precision casts the gradients in a comm hook of its own, in place of DDP's reduction OmniLearn times; "
                       "use the Trainer's (Fabric's) precision= instead",
    "delay_all_reduce_named_params": "DDP all-reduces those parameters after the backward, outside the step's timing; drop it",
    "param_to_hook_all_reduce": "DDP all-reduces the delayed parameters outside the step's timing; drop it",
    "total_steps": "the run's length is the Trainer's: pass Trainer(max_steps=N)",
    "accumulation_steps": "gradient accumulation is the Trainer's: pass Trainer(accumulate_grad_batches=K) (OmniLearn "
                          "then runs it exactly)",
    "device": "the device is the Trainer's: pass Trainer(accelerator=..., devices=...)",
}


FABRIC_ARGS = LIGHTNING_ARGS - {"precision_plugin"} | {"precision"}  # Fabric's DDPStrategy
FABRIC_TAKES = frozenset({"total_steps", "accumulation_steps"})  # no Trainer: the loop's settings are the session's


def split_options(options: dict[str, Any], who: str = "OmniLearnStrategy", framework: frozenset = LIGHTNING_ARGS,
                  takes: frozenset = frozenset()) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(the framework strategy's arguments, DDP arguments, ``omnilearn.setup()`` keywords); refusals raise.

    ``takes``: keywords of :data:`REFUSED` this strategy takes as ``omnilearn.setup()`` keywords (Fabric's).
    """
    lightning, ddp, settings = {}, {}, {}
    for name, value in options.items():
        if name in REFUSED and name not in takes:
            raise ConfigError(f"{who}({name}={value!r}) is not supported: {REFUSED[name]}")
        if name in BUFFER_BROADCAST:
            if value:
                raise ConfigError(f"{who}({name}={value!r}) is not supported: OmniLearn averages buffers "
                                  "(BatchNorm statistics) weighted by batch share every control interval; drop it")
            continue  # False is OmniLearn's own setting already
        if name in framework:
            lightning[name] = value
        elif name in DDP_ARGS:
            ddp[name] = value
        elif name in KEYWORDS:
            settings[name] = value
        else:
            raise ConfigError(f"{who} got an unknown keyword {name}={value!r}; it takes omnilearn.setup() keywords, "
                              f"DistributedDataParallel arguments and DDPStrategy's ({', '.join(sorted(framework))})")
    return lightning, ddp, settings


def refuse_sharded(model: object, strategy: str) -> None:
    """One line for a model sharded with ``fully_shard`` (FSDP2): these strategies are DDP; the route is your own loop."""
    from omnilearn.bsp.sharded import is_sharded

    if is_sharded(model):
        raise ConfigError(f"{type(model).__name__} is sharded with fully_shard (FSDP2), which {strategy} cannot "
                          "balance: train it in your own loop with ol.wrap_model(model) (docs/fsdp.md)")


def refuse_trainer_flags(trainer: Any, strategy: Any) -> None:
    """The Trainer flags ``OmniLearnStrategy`` cannot honour, refused in one line each at fit (docs/lightning.md)."""
    if getattr(strategy.precision_plugin, "scaler", None) is not None:
        raise ConfigError("Trainer(precision='16-mixed') uses a GradScaler, which OmniLearnStrategy does not support "
                          "(OmniLearn would record the scaled loss); use precision='bf16-mixed', '32-true' or '64-true'")
    if strategy._layer_sync is not None:
        raise ConfigError("Trainer(sync_batchnorm=True) is not supported by OmniLearnStrategy: SyncBatchNorm's "
                          "cross-rank backward ignores OmniLearn's per-worker gradient weights; drop it (OmniLearn "
                          "averages BatchNorm statistics by batch share every control interval)")
    for flag in ("fast_dev_run", "overfit_batches"):
        if getattr(trainer, flag):
            raise ConfigError(f"Trainer({flag}={getattr(trainer, flag)!r}) is not supported by OmniLearnStrategy: it "
                              "cuts the training epochs OmniLearn plans; shorten the run with Trainer(max_steps=N)")
    limit = trainer.limit_train_batches
    if isinstance(limit, int) or limit != 1.0:  # an int is a count of batches (1: one batch), a float a share
        raise ConfigError(f"Trainer(limit_train_batches={limit!r}) is not supported by "
                          "OmniLearnStrategy: OmniLearn plans whole epochs of the dataset; shorten the run with "
                          "Trainer(max_steps=N)")

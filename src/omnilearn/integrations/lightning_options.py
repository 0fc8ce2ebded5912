"""``OmniLearnStrategy(**options)``: which keyword goes where (Lightning, DDP, OmniLearn), and which is refused.

:func:`split_options` sorts the strategy's keywords into three groups:

- Lightning's ``DDPStrategy`` arguments (``accelerator``, ``cluster_environment``,
  ``checkpoint_io``, ``precision_plugin``, ``process_group_backend``, ``timeout``,
  ``start_method``, ``parallel_devices``);
- ``DistributedDataParallel`` arguments (``find_unused_parameters``,
  ``static_graph``, ``gradient_as_bucket_view``, ``bucket_cap_mb``...): they
  reach ``Session.wrap_model(model, **ddp_kwargs)``;
- :func:`omnilearn.setup` keywords (``global_batch``, ``speeds``, ``out``...).

Refused by name, each in one line with the supported route: a DDP comm hook
or model averaging (OmniLearn's weighted all-reduce is the comm hook), buffer
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
    "ddp_comm_hook": "OmniLearn's weighted all-reduce is the model's comm hook (it weights each worker by b_i/B)",
    "ddp_comm_state": "OmniLearn's weighted all-reduce is the model's comm hook (it weights each worker by b_i/B)",
    "ddp_comm_wrapper": "OmniLearn's weighted all-reduce is the model's comm hook (it weights each worker by b_i/B)",
    "model_averaging_period": "post-local SGD averages models unweighted; OmniLearn's steps are synchronous",
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

"""The keywords of ``setup()``, resolved against the world size: shared by the PyTorch and TensorFlow setups. Pure.

The world size is known only after joining (a process group, a
``tf.distribute`` cluster), so the batch may be given per worker
(``local_batch``) as well as in total (``global_batch``): :func:`check_keywords`
before joining, :func:`for_world` after.

Run: ``python -m pytest -q tests/unit/test_api_errors.py``
"""

from __future__ import annotations

import dataclasses
from typing import Any

from omnilearn.config import BalanceConfig, ConfigError
from omnilearn.emulation.speeds import speed_count

DEFAULT_LOCAL_BATCH = 32  # samples per worker per step when neither global_batch nor local_batch is given
KEYWORDS = frozenset(f.name for f in dataclasses.fields(BalanceConfig)) | {"total_steps", "local_batch"}


def check_keywords(who: str, settings: dict[str, Any], local_batch: int | None) -> None:
    """Unknown keywords and a batch given twice or badly, before anything is joined. ``who``: ``omnilearn.setup()``."""
    unknown = sorted(set(settings) - KEYWORDS)
    if unknown:
        raise ConfigError(f"{who} got an unknown keyword {unknown[0]}={settings[unknown[0]]!r}; "
                          f"valid ones: {', '.join(sorted(KEYWORDS))}")
    if local_batch is not None and "global_batch" in settings:
        raise ConfigError(f"global_batch={settings['global_batch']} and local_batch={local_batch} both given; "
                          "give one (global_batch = local_batch x workers)")
    if local_batch is not None and (type(local_batch) is not int or local_batch < 1):
        raise ConfigError(f"local_batch={local_batch!r} must be a positive integer (samples per worker per step)")


def for_world(config: BalanceConfig | None, settings: dict[str, Any], local_batch: int | None, world: int,
              group: str = "the process group", launch_hint: str = "torchrun --nproc-per-node {n} starts {n}"
              ) -> BalanceConfig:
    """The config for ``world`` workers: ``workers`` and ``speeds`` checked, the batch per worker multiplied out.

    ``group`` names what was joined, ``launch_hint`` how to start ``{n}`` workers (in the errors).
    """
    derived_min = "min_batch" not in settings and (config is None or config.workers is None)
    cfg = dataclasses.replace(config, **settings) if config is not None else BalanceConfig(**settings)
    if cfg.workers is not None and cfg.workers != world:
        raise ConfigError(f"workers={cfg.workers} but {group} has {world}; drop workers")
    said = speed_count(cfg.speeds)
    if said is not None and said != world:
        raise ConfigError(f"speeds={cfg.speeds!r} give {said} workers but {group} has {world} "
                          f"({launch_hint.format(n=said)}); give one speed per worker")
    if local_batch is None and config is None and "global_batch" not in settings:
        local_batch = DEFAULT_LOCAL_BATCH
    per_worker: dict[str, Any] = {} if local_batch is None else {"global_batch": local_batch * world}
    if derived_min:
        per_worker["min_batch"] = None  # derived from the batch per worker, now that the world size is known
    try:
        return dataclasses.replace(cfg, workers=world, **per_worker)
    except ConfigError as e:
        why = f"local_batch={local_batch} x {world} workers: {e}" if local_batch is not None else str(e)
        raise ConfigError(why) from None

"""``omnilearn.setup()``: join the process group, resolve the batch, open a :class:`~omnilearn.bsp.session.Session`.

The world size is known only after joining, so the batch may be given per
worker (``local_batch``) as well as in total (``global_batch``).

Run: ``python -m pytest -q tests/dist/test_api.py``
"""

from __future__ import annotations

import dataclasses
from typing import Any

from omnilearn.bsp.session import Session
from omnilearn.config import BalanceConfig, ConfigError, api_wording, dump_toml
from omnilearn.distributed import group
from omnilearn.emulation.speeds import speed_count
from omnilearn.observe.rundir import prepare

DEFAULT_LOCAL_BATCH = 32  # samples per worker per step when neither global_batch nor local_batch is given


def setup(config: BalanceConfig | None = None, *, total_steps: int | None = None, local_batch: int | None = None,
          **settings: Any) -> Session:
    """Join the process group (existing, torchrun's, or none) and start balancing.

    ``settings`` are :class:`~omnilearn.config.BalanceConfig` fields. The
    batch: ``global_batch=B`` (all workers together), or ``local_batch=b``
    (per worker: ``B = b x world size``, known only after joining), not both;
    neither: ``local_batch=32``. ``total_steps`` bounds the run (needed for
    ``speed_schedule="paper"`` and for streams). Mistakes raise
    :class:`~omnilearn.config.ConfigError`, one line naming the keyword.
    """
    try:
        return _setup(config, total_steps, local_batch, settings)
    except ConfigError as e:
        raise ConfigError(api_wording(str(e), KEYWORDS)) from None


KEYWORDS = frozenset(f.name for f in dataclasses.fields(BalanceConfig)) | {"total_steps", "local_batch"}


def _setup(config: BalanceConfig | None, total_steps: int | None, local_batch: int | None,
           settings: dict[str, Any]) -> Session:
    unknown = sorted(set(settings) - KEYWORDS)
    if unknown:
        raise ConfigError(f"omnilearn.setup() got an unknown keyword {unknown[0]}={settings[unknown[0]]!r}; "
                          f"valid ones: {', '.join(sorted(KEYWORDS))}")
    if local_batch is not None and "global_batch" in settings:
        raise ConfigError(f"global_batch={settings['global_batch']} and local_batch={local_batch} both given; "
                          "give one (global_batch = local_batch x workers)")
    if local_batch is not None and (type(local_batch) is not int or local_batch < 1):
        raise ConfigError(f"local_batch={local_batch!r} must be a positive integer (samples per worker per step)")
    derived_min = "min_batch" not in settings and (config is None or config.workers is None)
    cfg = dataclasses.replace(config, **settings) if config is not None else BalanceConfig(**settings)
    ctx = group.join(cfg.device, cfg.timeout_s)
    if cfg.workers is not None and cfg.workers != ctx.world_size:
        raise ConfigError(f"workers={cfg.workers} but the process group has {ctx.world_size}; drop workers")
    said = speed_count(cfg.speeds)
    if said is not None and said != ctx.world_size:
        raise ConfigError(f"speeds={cfg.speeds!r} give {said} workers but the process group has {ctx.world_size} "
                          f"(torchrun --nproc-per-node {said} starts {said}); give one speed per worker")
    if local_batch is None and config is None and "global_batch" not in settings:
        local_batch = DEFAULT_LOCAL_BATCH
    per_worker = {} if local_batch is None else {"global_batch": local_batch * ctx.world_size}
    if derived_min:
        per_worker["min_batch"] = None  # derived from the batch per worker, now that the world size is known
    try:
        cfg = dataclasses.replace(cfg, workers=ctx.world_size, **per_worker)
    except ConfigError as e:
        why = f"local_batch={local_batch} x {ctx.world_size} workers: {e}" if local_batch is not None else str(e)
        raise ConfigError(why) from None
    run_dir = prepare(cfg.out, cfg.overwrite, dump_toml(cfg)) if cfg.out is not None and ctx.is_main else None
    return Session(cfg, ctx, run_dir, total_steps)
